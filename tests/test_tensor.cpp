// Tensor views: shared storage, offsets, shapes, and the errors of views that cannot exist.
#include "backend/cpu/cpu_device.h"
#include "core/tensor.h"

#include <gtest/gtest.h>

using namespace loom;

TEST(Tensor, EmptyHasShapeDtypeAndDevice) {
    Tensor t = Tensor::empty({2, 3, 4}, DType::bf16, cpu::device());
    EXPECT_EQ(t.dim(), 3);
    EXPECT_EQ(t.numel(), 24);
    EXPECT_EQ(t.nbytes(), 48u);
    EXPECT_EQ(t.size(-1), 4);
    EXPECT_EQ(t.device().name(), "cpu:0");
    EXPECT_EQ(t.memory_kind(), MemoryKind::device);
    EXPECT_EQ(t.describe(), "bfloat16(2, 3, 4) on cpu:0 device");
    EXPECT_THROW(t.size(3), Error);
}

TEST(Tensor, ViewAndFlattenShareStorage) {
    Tensor t = Tensor::zeros({4, 6}, DType::f32, cpu::device());
    Tensor v = t.view({3, -1});
    EXPECT_EQ(v.shape(), (Shape{3, 8}));
    EXPECT_TRUE(v.shares_storage(t));
    v.data<float>()[9] = 5.0f;
    EXPECT_EQ(t.flatten().data<float>()[9], 5.0f);
    EXPECT_EQ(t.data<float>()[9], 5.0f);
    EXPECT_THROW(t.view({5, 5}), Error);
    EXPECT_THROW(t.view({-1, -1}), Error);
    EXPECT_THROW(t.view({7, -1}), Error);
    EXPECT_THROW(t.data<int32_t>(), Error) << "typed access with the wrong element type";
}

TEST(Tensor, NarrowAlongFirstNonUnitDimension) {
    Tensor t = Tensor::zeros({5, 4}, DType::f32, cpu::device());
    for (int i = 0; i < 20; ++i) {
        t.data<float>()[i] = static_cast<float>(i);
    }
    Tensor rows = t.narrow(0, 2, 2);   // rows 2 and 3
    EXPECT_EQ(rows.shape(), (Shape{2, 4}));
    EXPECT_EQ(rows.offset(), 8);
    EXPECT_EQ(rows.data<float>()[0], 8.0f);
    EXPECT_EQ(rows.data<float>()[7], 15.0f);
    // Narrowing a (1, 4) row along its columns stays contiguous.
    Tensor cols = rows.narrow(0, 1, 1).narrow(1, 1, 2);
    EXPECT_EQ(cols.offset(), 13);
    EXPECT_EQ(cols.data<float>()[1], 14.0f);
    EXPECT_THROW(t.narrow(1, 0, 2), Error) << "columns of a 5-row matrix are not contiguous";
    EXPECT_THROW(t.narrow(0, 4, 2), Error);
}

TEST(Tensor, SlicesOfAFlatBufferAreShapedViews) {
    // The DDP buffer pattern: one flat buffer, parameters as shaped views at their offsets.
    Tensor buffer = Tensor::zeros({128}, DType::bf16, cpu::device());
    Tensor w      = buffer.slice(64, {4, 8});
    Tensor b      = buffer.slice(96, {8});
    EXPECT_EQ(w.offset(), 64);
    EXPECT_EQ(static_cast<char *>(w.data_ptr()) - static_cast<char *>(buffer.data_ptr()), 128);
    w.data<bf16_t>()[31] = bf16_t{0x3f80};
    EXPECT_EQ(buffer.data<bf16_t>()[95].bits, 0x3f80);
    EXPECT_EQ(b.data<bf16_t>()[0].bits, 0);
    // A slice of a slice offsets from the slice.
    Tensor inner = w.slice(8, {8});
    EXPECT_EQ(inner.offset(), 72);
    EXPECT_THROW(buffer.slice(100, {4, 8}), Error);
    EXPECT_THROW(w.slice(-1, {2}), Error);
}

TEST(Tensor, StorageIsFreedWithTheLastView) {
    Allocator & alloc  = cpu::device().allocator(MemoryKind::device);
    int64_t     before = alloc.pool_stats("tensor-test").allocated;
    Tensor      view;
    {
        Tensor t = Tensor::empty({1000}, DType::f32, cpu::device(), {MemoryKind::device, "tensor-test"});
        EXPECT_EQ(alloc.pool_stats("tensor-test").allocated, before + 4000);
        view = t.slice(10, {10});
    }
    EXPECT_EQ(alloc.pool_stats("tensor-test").allocated, before + 4000) << "the view keeps the storage alive";
    view = Tensor();
    EXPECT_EQ(alloc.pool_stats("tensor-test").allocated, before);
}

TEST(Tensor, PinnedHostTensorsAreAccountedApart) {
    Allocator & device = cpu::device().allocator(MemoryKind::device);
    Allocator & pinned = cpu::device().allocator(MemoryKind::pinned_host);
    int64_t d0 = device.stats().allocated;
    int64_t p0 = pinned.stats().allocated;
    Tensor  t  = Tensor::empty({256}, DType::f32, cpu::device(), {MemoryKind::pinned_host, kDefaultPool});
    EXPECT_EQ(t.memory_kind(), MemoryKind::pinned_host);
    EXPECT_EQ(pinned.stats().allocated, p0 + 1024);
    EXPECT_EQ(device.stats().allocated, d0);
}

TEST(Tensor, FromBlobWrapsWithoutOwning) {
    float  data[6] = {1, 2, 3, 4, 5, 6};
    Tensor t       = Tensor::from_blob(data, {2, 3}, DType::f32, cpu::device());
    EXPECT_EQ(t.data<float>(), data);
    Tensor copy = Tensor::empty({6}, DType::f32, cpu::device());
    copy.copy_from(t);
    EXPECT_EQ(copy.data<float>()[5], 6.0f);
    EXPECT_THROW(copy.copy_from(Tensor::empty({5}, DType::f32, cpu::device())), Error);
}

// core/atomic_file: a write lands whole, and a path that is not a regular file is never replaced.
#include "core/atomic_file.h"

#include <sys/stat.h>
#include <unistd.h>

TEST(AtomicFile, WritesWholeAndRefusesToReplaceAFifoOrAFolder) {
    std::string dir = "/tmp/loom_atomic_" + std::to_string(::getpid());
    ::mkdir(dir.c_str(), 0755);
    std::string file = dir + "/out.txt";
    write_file_atomically(file, "first");
    write_file_atomically(file, "second");
    std::FILE * f = std::fopen(file.c_str(), "rb");
    ASSERT_NE(f, nullptr);
    char buffer[16] = {};
    EXPECT_EQ(std::fread(buffer, 1, sizeof(buffer), f), 6u);
    std::fclose(f);
    EXPECT_STREQ(buffer, "second");
    std::string fifo = dir + "/fifo";
    ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
    for (const std::string & target : {fifo, dir}) {
        try {
            write_file_atomically(target, "x");
            ADD_FAILURE() << "replaced " << target;
        } catch (const Error & e) {
            EXPECT_NE(e.message().find("is not a regular file"), std::string::npos) << e.message();
        }
        EXPECT_NE(::access((target + ".tmp." + std::to_string(::getpid())).c_str(), F_OK), 0) << "temporary left behind";
    }
    struct stat st;
    ASSERT_EQ(::stat(fifo.c_str(), &st), 0);
    EXPECT_TRUE(S_ISFIFO(st.st_mode)) << "the FIFO is still a FIFO";
    std::remove(fifo.c_str());
    std::remove(file.c_str());
    ::rmdir(dir.c_str());
}

// The NCCL stand-in of the emulated CUDA device (cuda-emu): the part of NCCL's API that Loom's NCCL
// communicator (comm/nccl_communicator.cpp) uses, with NCCL's names, types and values, implemented in
// cuda_emu/nccl.cpp between the processes of one machine over POSIX shared memory.
//
// What holds as on NCCL: a communicator is made by ncclCommInitRank from an id that one rank made with
// ncclGetUniqueId and passed to the others (Loom broadcasts it over MPI); every operation is enqueued on a
// stream and runs in stream order; the collectives of a communicator, and the sends and receives between two
// of its ranks, match across ranks in the order they run, so ranks that issue them in different orders get
// an error, wrong data or a hang; a send completes only once the peer's matching receive has taken the data,
// so two ranks that both send before receiving (outside a group) deadlock; the operations between
// ncclGroupStart and ncclGroupEnd start together and progress concurrently. Reductions are deterministic:
// every rank computes in[0] op in[1] op ... in rank order, f16 and bf16 in f32 rounded once.
//
// What the emulator adds: a blocked operation does not hang silently when the communicator is aborted
// (ncclCommAbort, from another thread), a peer aborts or fails, a peer process dies, or a peer destroys the
// communicator while this rank still waits for it: the operation stops and ncclCommGetAsyncError and
// ncclGetLastError report it, naming the peer. Collectives whose kind, size, type, operator or root differ
// between ranks are reported as an error where NCCL would compute garbage.
//
// Everything lives in namespace loom_emu (a binary may also link the real NCCL); the using-directive at the
// end brings the names into the global namespace for the backend's sources.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#define NCCL_MAJOR 2
#define NCCL_MINOR 21
#define NCCL_PATCH 5
#define NCCL_SUFFIX "-loom-emu"
#define NCCL_VERSION(X, Y, Z) (((X) <= 2 && (Y) <= 8) ? (X) * 1000 + (Y) * 100 + (Z) : (X) * 10000 + (Y) * 100 + (Z))
#define NCCL_VERSION_CODE NCCL_VERSION(NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH)

// Set by the stand-in only, for code that must tell the emulator from the real library.
#define LOOM_EMU_NCCL 1

#define NCCL_UNIQUE_ID_BYTES 128

namespace loom_emu {

// NCCL's result codes, with NCCL's values.
enum ncclResult_t : int {
    ncclSuccess            = 0,
    ncclUnhandledCudaError = 1,
    ncclSystemError        = 2,
    ncclInternalError      = 3,
    ncclInvalidArgument    = 4,
    ncclInvalidUsage       = 5,
    ncclRemoteError        = 6,
    ncclInProgress         = 7,
    ncclNumResults         = 8,
};

enum ncclDataType_t : int {
    ncclInt8     = 0,
    ncclChar     = 0,
    ncclUint8    = 1,
    ncclInt32    = 2,
    ncclInt      = 2,
    ncclUint32   = 3,
    ncclInt64    = 4,
    ncclUint64   = 5,
    ncclFloat16  = 6,
    ncclHalf     = 6,
    ncclFloat32  = 7,
    ncclFloat    = 7,
    ncclFloat64  = 8,
    ncclDouble   = 8,
    ncclBfloat16 = 9,
    ncclNumTypes = 10,
};

enum ncclRedOp_t : int {
    ncclSum      = 0,
    ncclProd     = 1,
    ncclMax      = 2,
    ncclMin      = 3,
    ncclAvg      = 4,   // floating-point types only (integer types are refused with ncclInvalidArgument)
    ncclNumOps   = 5,
    ncclMaxRedOp = 0x7fffffff,
};

// The id of a communicator: a shared-memory name, made by ncclGetUniqueId and copied as plain bytes.
struct ncclUniqueId {
    char internal[NCCL_UNIQUE_ID_BYTES];
};

struct ncclComm;
using ncclComm_t = ncclComm *;

ncclResult_t ncclGetVersion(int * version);
ncclResult_t ncclGetUniqueId(ncclUniqueId * unique_id);

// Collective over the `nranks` members, which must all call it with the same id (each from its own process or
// thread): blocks until all have joined, for at most LOOM_EMU_NCCL_INIT_TIMEOUT_S seconds (default 60).
ncclResult_t ncclCommInitRank(ncclComm_t * comm, int nranks, ncclUniqueId comm_id, int rank);

// Waits for the communicator's running operations, then frees it: its later operations on this rank's streams
// fail. Peers still waiting for this rank then fail too, naming it.
ncclResult_t ncclCommDestroy(ncclComm_t comm);

// Stops the communicator's blocked and later operations (on this rank, and makes its peers' fail, naming this
// rank) and returns once its running operations have stopped. Unlike NCCL, the handle stays valid, so that
// ncclCommGetAsyncError and ncclGetLastError can still be asked; ncclCommDestroy frees it.
ncclResult_t ncclCommAbort(ncclComm_t comm);

// ncclSuccess while the communicator is fine; once an operation failed (an abort here or on a peer, a peer
// that died, a mismatch, the timeout LOOM_EMU_NCCL_TIMEOUT_S), that operation's error.
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t * async_error);
ncclResult_t ncclCommCount(const ncclComm_t comm, int * count);
ncclResult_t ncclCommUserRank(const ncclComm_t comm, int * rank);

const char * ncclGetErrorString(ncclResult_t result);
// The communicator's first error in words (naming the operation and the peer), or, for a null communicator or
// one without error, the last error of a call made by this thread; "" if none.
const char * ncclGetLastError(ncclComm_t comm);

ncclResult_t ncclAllReduce(const void * sendbuff, void * recvbuff, size_t count, ncclDataType_t datatype,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream);
// In place when recvbuff == sendbuff + rank * recvcount elements.
ncclResult_t ncclReduceScatter(const void * sendbuff, void * recvbuff, size_t recvcount, ncclDataType_t datatype,
                               ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream);
// In place when sendbuff == recvbuff + rank * sendcount elements.
ncclResult_t ncclAllGather(const void * sendbuff, void * recvbuff, size_t sendcount, ncclDataType_t datatype,
                           ncclComm_t comm, cudaStream_t stream);
// sendbuff is read on `root` only.
ncclResult_t ncclBroadcast(const void * sendbuff, void * recvbuff, size_t count, ncclDataType_t datatype, int root,
                           ncclComm_t comm, cudaStream_t stream);
// recvbuff is written on `root` only.
ncclResult_t ncclReduce(const void * sendbuff, void * recvbuff, size_t count, ncclDataType_t datatype,
                        ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclSend(const void * sendbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream);
ncclResult_t ncclRecv(void * recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream);

// Per thread and nestable; the outermost ncclGroupEnd enqueues the group's operations, one unit per stream.
ncclResult_t ncclGroupStart();
ncclResult_t ncclGroupEnd();

}  // namespace loom_emu

using namespace loom_emu;

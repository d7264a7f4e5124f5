#include "plan/cost_model.h"

#include "core/error.h"

#include <algorithm>
#include <cmath>
#include <sstream>

namespace loom::plan {

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
constexpr double kT   = 1e12;
constexpr double kG   = 1e9;

// The SXM parts in their HGX/DGX systems: dense peaks (half the "with sparsity" figures), one direction of
// NVLink (half the bidirectional total), one 400 Gb/s (H100, H200, B200) or 200 Gb/s (A100) NIC per GPU.
const std::vector<GpuSpec> & specs() {
    static const std::vector<GpuSpec> table = {
        {"h100-80gb", static_cast<int64_t>(80 * kGiB), 989.4 * kT, 494.7 * kT, 3.35e12, 450 * kG, 50 * kG, 64 * kG,
         "NVIDIA H100 Tensor Core GPU datasheet (SXM5): 989.4 TFLOP/s bf16 and 494.7 TF32 dense, 3.35 TB/s HBM3, "
         "NVLink 900 GB/s; DGX H100: one 400 Gb/s ConnectX-7 per GPU; PCIe Gen5 x16"},
        {"h200", static_cast<int64_t>(141e9), 989.4 * kT, 494.7 * kT, 4.8e12, 450 * kG, 50 * kG, 64 * kG,
         "NVIDIA H200 Tensor Core GPU datasheet (SXM): 141 GB HBM3e at 4.8 TB/s, H100's compute and NVLink; "
         "one 400 Gb/s NIC per GPU; PCIe Gen5 x16"},
        {"a100-80gb", static_cast<int64_t>(80 * kGiB), 312 * kT, 156 * kT, 2.039e12, 300 * kG, 25 * kG, 32 * kG,
         "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB): 312 TFLOP/s bf16 and 156 TF32 dense, 2.039 TB/s "
         "HBM2e, NVLink 600 GB/s; DGX A100: one 200 Gb/s HDR NIC per GPU; PCIe Gen4 x16"},
        {"b200", static_cast<int64_t>(180e9), 2250 * kT, 1125 * kT, 8e12, 900 * kG, 50 * kG, 64 * kG,
         "NVIDIA HGX B200 datasheet: 36 PFLOP/s bf16 and 18 TF32 with sparsity for 8 GPUs (2.25 and 1.125 dense "
         "per GPU), 1.44 TB HBM3e at 64 TB/s, NVLink 1.8 TB/s per GPU; DGX B200: one 400 Gb/s NIC per GPU"},
    };
    return table;
}

}  // namespace

std::vector<std::string> gpu_names() {
    std::vector<std::string> names;
    for (const GpuSpec & s : specs()) names.push_back(s.name);
    return names;
}

const GpuSpec & gpu_spec(const std::string & name) {
    for (const GpuSpec & s : specs()) {
        if (s.name == name) return s;
    }
    std::ostringstream choices;
    for (const std::string & n : gpu_names()) choices << (choices.tellp() > 0 ? ", " : "") << n;
    LOOM_THROW("--gpu " << name << " is not a GPU loom plan knows", "choose one of " << choices.str() << ", or cpu (this machine)");
}

std::string gpu_for_product(const std::string & product) {
    auto has = [&](const char * part) { return product.find(part) != std::string::npos; };
    if (has("PCIe") || has("NVL")) return {};
    if (has("H100") && has("80GB")) return "h100-80gb";
    if (has("H200")) return "h200";
    if (has("A100") && has("80GB")) return "a100-80gb";
    if (has("B200")) return "b200";
    return {};
}

CostModel::CostModel(GpuSpec gpu, int gpus_per_node, DType math, Efficiencies efficiency)
    : gpu_(std::move(gpu)), gpus_per_node_(gpus_per_node), math_(math), efficiency_(efficiency) {
    LOOM_CHECK(gpus_per_node_ >= 1, "--gpus-per-node " << gpus_per_node_, "give at least 1");
}

double CostModel::tensor_core_flops() const { return dtype_is_half(math_) ? gpu_.tensor_16bit_flops : gpu_.tf32_flops; }

double CostModel::kernel_seconds(double flops, double bytes, double efficiency) const {
    const double compute = flops > 0 ? flops / (tensor_core_flops() * efficiency) : 0.0;
    const double memory  = bytes / (gpu_.hbm_bytes_per_s * efficiency_.memory);
    return efficiency_.launch_s + std::max(compute, memory);
}

double CostModel::host_copy_seconds(double bytes) const {
    return efficiency_.launch_s + bytes / (gpu_.host_bytes_per_s * efficiency_.host);
}

bool CostModel::within_one_node(const std::vector<int> & global_ranks) const {
    if (global_ranks.empty()) return true;
    const int node = global_ranks.front() / gpus_per_node_;
    return std::all_of(global_ranks.begin(), global_ranks.end(), [&](int r) { return r / gpus_per_node_ == node; });
}

double CostModel::collective_seconds(CollectiveKind kind, double bytes, const std::vector<int> & global_ranks, int peers) const {
    const double n = static_cast<double>(global_ranks.size());
    if (kind != CollectiveKind::point_to_point && n <= 1) return 0.0;
    const bool   local = within_one_node(global_ranks);
    const double bw    = local ? gpu_.nvlink_bytes_per_s * efficiency_.nvlink
                               : gpu_.network_bytes_per_s * efficiency_.network;
    const double step  = local ? efficiency_.nvlink_step_s : efficiency_.network_step_s;
    if (kind == CollectiveKind::all_to_all && peers >= 0) return peers * step + bytes / bw;
    switch (kind) {
    case CollectiveKind::all_reduce: return 2 * (n - 1) * step + 2 * (n - 1) / n * bytes / bw;
    case CollectiveKind::reduce_scatter:
    case CollectiveKind::all_gather:
    case CollectiveKind::all_to_all: return (n - 1) * step + (n - 1) / n * bytes / bw;
    case CollectiveKind::broadcast:
    case CollectiveKind::point_to_point: return step + bytes / bw;
    }
    return 0.0;
}

}  // namespace loom::plan

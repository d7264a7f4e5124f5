// `loom plan`'s time model: what one op, one collective or one copy costs on a given GPU and cluster.
//
// The meta device (plan/meta_device.h) runs a rank's real iteration; with a CostModel each of its ops and
// collectives advances the modelled clock of the stream it was issued on, and events, waits and host
// synchronisations order the clocks as they order a GPU's streams. So the time of a step is not a formula
// over the model: it is the real code's sequence of kernels and collectives, each priced here.
//
// Compute, per op (a roofline with stated efficiencies):
//   t = launch + max(flops / (peak x efficiency), bytes / (HBM bandwidth x memory efficiency))
// where peak is the tensor-core rate of the model's precision for GEMMs and attention (bf16 or fp16 with
// --bf16/--fp16, TF32 otherwise) and flops are 2 m n k for a GEMM, and for attention 4 b a d times the
// (query, key) pairs the causal mask keeps in the forward, 2.5 times that in the backward (it recomputes
// the scores: five matrix products against two). Elementwise ops and reductions move their tensors' bytes.
//
// Collectives over a group of n ranks with B bytes (the full tensor), NCCL's ring algorithm, whose bus
// bandwidth is the link's (nccl-tests' definition, docs/plan.md):
//   all-reduce          2 (n - 1) / n x B / bw        reduce-scatter, all-gather   (n - 1) / n x B / bw
//   all-to-all          (n - 1) / n x B / bw          send, receive, broadcast      B / bw
// plus a latency per ring step. bw is the NVLink bandwidth when the whole group sits in one node
// (ranks / gpus-per-node equal), else the network's per GPU.
#pragma once

#include "core/dtype.h"

#include <cstdint>
#include <string>
#include <vector>

namespace loom::plan {

// One GPU model's datasheet figures: dense (no sparsity) peaks, one direction of each link.
struct GpuSpec {
    std::string name;                    // as --gpu names it: h100-80gb, h200, a100-80gb, b200
    int64_t     memory_bytes      = 0;   // HBM capacity
    double      tensor_16bit_flops = 0;  // bf16/fp16 dense tensor-core FLOP/s
    double      tf32_flops        = 0;   // TF32 dense tensor-core FLOP/s (f32 models' GEMMs)
    double      hbm_bytes_per_s   = 0;
    double      nvlink_bytes_per_s  = 0;   // per GPU, one direction
    double      network_bytes_per_s = 0;   // per GPU, one direction (its NIC)
    double      host_bytes_per_s    = 0;   // PCIe, one direction
    const char * source = "";
};

// The fractions of those peaks real kernels reach, and fixed costs. Each has its source in docs/plan.md.
struct Efficiencies {
    double gemm          = 0.70;   // large bf16 GEMMs (cuBLASLt)
    double attention     = 0.55;   // fused flash attention, forward and backward
    double memory        = 0.80;   // streaming elementwise kernels of HBM bandwidth
    double nvlink        = 0.80;   // NCCL ring bus bandwidth of NVLink's
    double network       = 0.85;   // NCCL bus bandwidth of the NIC's
    double host          = 0.80;   // pinned copies of PCIe's
    double launch_s      = 2e-6;   // per kernel: launch and tail
    double nvlink_step_s = 5e-6;   // per ring step inside a node
    double network_step_s = 15e-6; // per ring step across nodes
};

// --gpu's names: h100-80gb, h200, a100-80gb, b200. Throws naming the value and the choices otherwise.
const GpuSpec &          gpu_spec(const std::string & name);
std::vector<std::string> gpu_names();
// The --gpu name of a CUDA device by its product name (cudaDeviceProp::name): the SXM parts of the table,
// "NVIDIA H100 80GB HBM3" -> h100-80gb, "NVIDIA H200" -> h200, "NVIDIA A100-SXM4-80GB" -> a100-80gb,
// "NVIDIA B200" -> b200. Empty for anything else (PCIe and NVL variants have other clocks and memory).
std::string gpu_for_product(const std::string & product);

enum class CollectiveKind { all_reduce, reduce_scatter, all_gather, all_to_all, broadcast, point_to_point };

class CostModel {
public:
    // `gpus_per_node` decides which groups stay on NVLink; `math` is the precision of tensor-core work
    // (the model's parameter dtype: bf16, f16, or f32 for TF32).
    CostModel(GpuSpec gpu, int gpus_per_node, DType math, Efficiencies efficiency = {});

    const GpuSpec &      gpu() const { return gpu_; }
    const Efficiencies & efficiency() const { return efficiency_; }
    int                  gpus_per_node() const { return gpus_per_node_; }

    double tensor_core_flops() const;   // the peak GEMMs and attention run at
    // The memory a plan may fill: 95% of the GPU's, the rest for the CUDA context, NCCL's buffers and the
    // allocator's fragmentation (assumed).
    int64_t usable_memory_bytes() const { return static_cast<int64_t>(0.95 * static_cast<double>(gpu_.memory_bytes)); }
    // Seconds of one kernel: compute-bound work at `flops` on tensor cores at `efficiency`, memory-bound at
    // `bytes` of HBM traffic, whichever is longer, plus the launch.
    double kernel_seconds(double flops, double bytes, double efficiency) const;
    double memory_seconds(double bytes) const { return kernel_seconds(0, bytes, 1); }
    // A copy between host and device memory over PCIe.
    double host_copy_seconds(double bytes) const;
    // A collective of `bytes` (the full tensor: the all-reduce's, the reduce-scatter's input, the
    // all-gather's output, the all-to-all's send buffer, the message) over the ranks `global_ranks`. An
    // all-to-all that sends to only some of the others (a ring's pass: one) gives `peers`, how many it sends to,
    // and `bytes`, what it sends them: a step per peer and the bytes at the link's bandwidth.
    double collective_seconds(CollectiveKind kind, double bytes, const std::vector<int> & global_ranks, int peers = -1) const;
    bool   within_one_node(const std::vector<int> & global_ranks) const;

private:
    GpuSpec      gpu_;
    int          gpus_per_node_;
    DType        math_;
    Efficiencies efficiency_;
};

}  // namespace loom::plan

#include "backend/cpu/dnnl_check.h"

namespace loom::cpu {

const char * dnnl_status_string(dnnl_status_t status) {
    switch (status) {
        case dnnl_success:           return "success";
        case dnnl_out_of_memory:     return "out of memory";
        case dnnl_invalid_arguments: return "invalid arguments";
        case dnnl_unimplemented:     return "unimplemented (no primitive for these shapes/dtypes on this CPU)";
        case dnnl_runtime_error:     return "runtime error";
        case dnnl_not_required:      return "not required";
        default:                     return "unknown oneDNN status";
    }
}

}  // namespace loom::cpu

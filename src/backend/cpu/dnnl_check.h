// LOOM_DNNL_CHECK: oneDNN status checks, generated like every other library check (core/error.h).
#pragma once

#include "core/error.h"

#include <oneapi/dnnl/dnnl.h>

namespace loom::cpu {
const char * dnnl_status_string(dnnl_status_t status);
}

#define LOOM_DNNL_CHECK(expr)                                                                          \
    LOOM_CHECK_STATUS(expr, dnnl_success, ::loom::cpu::dnnl_status_string, "oneDNN",                   \
                      "set ONEDNN_VERBOSE=1 to see the primitive that failed and its shapes")

// The emulated device's stand-in for cuDNN 9's graph (backend) API (cuda-emu): handles, backend descriptors
// (tensors, pointwise, matmul, reduction and reshape operations, operation graphs, the engine heuristic, engine
// configurations, execution plans, variant packs) and cudnnBackendExecute, which runs the operation graph on
// the host in a node on the handle's stream (cudnn.cpp). Names, signatures and enum values are cuDNN 9's;
// only what the CUDA backend's fused attention builds (backend/cuda/fused_attention.cpp) has behaviour behind
// it: other descriptor types, attributes and modes are refused with CUDNN_STATUS_NOT_SUPPORTED.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace loom_emu {

struct DnnContext;
struct DnnDescriptor;

using cudnnHandle_t            = DnnContext *;
using cudnnBackendDescriptor_t = DnnDescriptor *;

enum cudnnStatus_t : int {
    CUDNN_STATUS_SUCCESS           = 0,
    CUDNN_STATUS_NOT_INITIALIZED   = 1001,
    CUDNN_STATUS_BAD_PARAM         = 2000,
    CUDNN_STATUS_NOT_SUPPORTED     = 3000,
    CUDNN_STATUS_INTERNAL_ERROR    = 4000,
    CUDNN_STATUS_EXECUTION_FAILED  = 5000,
};

enum cudnnDataType_t : int {
    CUDNN_DATA_FLOAT    = 0,
    CUDNN_DATA_HALF     = 2,
    CUDNN_DATA_INT32    = 4,
    CUDNN_DATA_BFLOAT16 = 9,
    CUDNN_DATA_INT64    = 10,
    CUDNN_DATA_BOOLEAN  = 11,
};

enum cudnnBackendAttributeType_t : int {
    CUDNN_TYPE_HANDLE                  = 0,
    CUDNN_TYPE_DATA_TYPE               = 1,
    CUDNN_TYPE_BOOLEAN                 = 2,
    CUDNN_TYPE_INT64                   = 3,
    CUDNN_TYPE_FLOAT                   = 4,
    CUDNN_TYPE_DOUBLE                  = 5,
    CUDNN_TYPE_VOID_PTR                = 6,
    CUDNN_TYPE_HEUR_MODE               = 8,
    CUDNN_TYPE_POINTWISE_MODE          = 14,
    CUDNN_TYPE_BACKEND_DESCRIPTOR      = 15,
    CUDNN_TYPE_REDUCTION_OPERATOR_TYPE = 18,
};

enum cudnnBackendDescriptorType_t : int {
    CUDNN_BACKEND_POINTWISE_DESCRIPTOR           = 0,
    CUDNN_BACKEND_ENGINE_DESCRIPTOR              = 2,
    CUDNN_BACKEND_ENGINECFG_DESCRIPTOR           = 3,
    CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR          = 4,
    CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR      = 5,
    CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR = 13,
    CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR      = 15,
    CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR        = 16,
    CUDNN_BACKEND_TENSOR_DESCRIPTOR              = 17,
    CUDNN_BACKEND_MATMUL_DESCRIPTOR              = 18,
    CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR    = 19,
    CUDNN_BACKEND_REDUCTION_DESCRIPTOR           = 21,
    CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR = 22,
    CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR   = 31,
};

enum cudnnBackendAttributeName_t : int {
    CUDNN_ATTR_POINTWISE_MODE      = 0,
    CUDNN_ATTR_POINTWISE_MATH_PREC = 1,
    CUDNN_ATTR_POINTWISE_AXIS      = 9,

    CUDNN_ATTR_ENGINEHEUR_MODE            = 200,
    CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH = 201,
    CUDNN_ATTR_ENGINEHEUR_RESULTS         = 202,

    CUDNN_ATTR_ENGINECFG_ENGINE = 300,

    CUDNN_ATTR_EXECUTION_PLAN_HANDLE         = 400,
    CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG  = 401,
    CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE = 402,

    CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR = 750,
    CUDNN_ATTR_OPERATION_POINTWISE_XDESC         = 751,
    CUDNN_ATTR_OPERATION_POINTWISE_BDESC         = 752,
    CUDNN_ATTR_OPERATION_POINTWISE_YDESC         = 753,
    CUDNN_ATTR_OPERATION_POINTWISE_TDESC         = 758,

    CUDNN_ATTR_OPERATIONGRAPH_HANDLE = 800,
    CUDNN_ATTR_OPERATIONGRAPH_OPS    = 801,

    CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT = 900,
    CUDNN_ATTR_TENSOR_DATA_TYPE      = 901,
    CUDNN_ATTR_TENSOR_DIMENSIONS     = 902,
    CUDNN_ATTR_TENSOR_STRIDES        = 903,
    CUDNN_ATTR_TENSOR_UNIQUE_ID      = 906,
    CUDNN_ATTR_TENSOR_IS_VIRTUAL     = 907,
    CUDNN_ATTR_TENSOR_IS_BY_VALUE    = 908,

    CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS    = 1000,
    CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS = 1001,
    CUDNN_ATTR_VARIANT_PACK_WORKSPACE     = 1003,

    CUDNN_ATTR_ENGINE_OPERATION_GRAPH = 1300,
    CUDNN_ATTR_ENGINE_GLOBAL_INDEX    = 1301,

    CUDNN_ATTR_MATMUL_COMP_TYPE = 1500,

    CUDNN_ATTR_OPERATION_MATMUL_ADESC = 1520,
    CUDNN_ATTR_OPERATION_MATMUL_BDESC = 1521,
    CUDNN_ATTR_OPERATION_MATMUL_CDESC = 1522,
    CUDNN_ATTR_OPERATION_MATMUL_DESC  = 1523,

    CUDNN_ATTR_REDUCTION_OPERATOR  = 1600,
    CUDNN_ATTR_REDUCTION_COMP_TYPE = 1601,

    CUDNN_ATTR_OPERATION_REDUCTION_XDESC = 1610,
    CUDNN_ATTR_OPERATION_REDUCTION_YDESC = 1611,
    CUDNN_ATTR_OPERATION_REDUCTION_DESC  = 1612,

    CUDNN_ATTR_OPERATION_RESHAPE_XDESC = 2200,
    CUDNN_ATTR_OPERATION_RESHAPE_YDESC = 2201,
};

enum cudnnPointwiseMode_t : int {
    CUDNN_POINTWISE_ADD           = 0,
    CUDNN_POINTWISE_MUL           = 1,
    CUDNN_POINTWISE_MIN           = 2,
    CUDNN_POINTWISE_MAX           = 3,
    CUDNN_POINTWISE_DIV           = 6,
    CUDNN_POINTWISE_SUB           = 9,
    CUDNN_POINTWISE_EXP           = 13,
    CUDNN_POINTWISE_LOG           = 15,
    CUDNN_POINTWISE_NEG           = 16,
    CUDNN_POINTWISE_IDENTITY      = 21,
    CUDNN_POINTWISE_RECIPROCAL    = 22,
    CUDNN_POINTWISE_CMP_GT        = 302,
    CUDNN_POINTWISE_CMP_GE        = 303,
    CUDNN_POINTWISE_CMP_LT        = 304,
    CUDNN_POINTWISE_CMP_LE        = 305,
    CUDNN_POINTWISE_GEN_INDEX     = 501,
    CUDNN_POINTWISE_BINARY_SELECT = 601,
};

enum cudnnReduceTensorOp_t : int {
    CUDNN_REDUCE_TENSOR_ADD = 0,
    CUDNN_REDUCE_TENSOR_MAX = 3,
};

enum cudnnBackendHeurMode_t : int {
    CUDNN_HEUR_MODE_INSTANT  = 0,
    CUDNN_HEUR_MODE_B        = 1,
    CUDNN_HEUR_MODE_FALLBACK = 2,
    CUDNN_HEUR_MODE_A        = 3,
};

// The emulation's version: cuDNN 9.10.0 (major * 10000 + minor * 100 + patch).
size_t cudnnGetVersion();
const char * cudnnGetErrorString(cudnnStatus_t status);
void cudnnGetLastErrorString(char * message, size_t max_size);

cudnnStatus_t cudnnCreate(cudnnHandle_t * handle);
cudnnStatus_t cudnnDestroy(cudnnHandle_t handle);
cudnnStatus_t cudnnSetStream(cudnnHandle_t handle, cudaStream_t stream);

cudnnStatus_t cudnnBackendCreateDescriptor(cudnnBackendDescriptorType_t descriptorType,
                                           cudnnBackendDescriptor_t * descriptor);
cudnnStatus_t cudnnBackendDestroyDescriptor(cudnnBackendDescriptor_t descriptor);
cudnnStatus_t cudnnBackendFinalize(cudnnBackendDescriptor_t descriptor);
cudnnStatus_t cudnnBackendSetAttribute(cudnnBackendDescriptor_t descriptor, cudnnBackendAttributeName_t attributeName,
                                       cudnnBackendAttributeType_t attributeType, int64_t elementCount,
                                       const void * arrayOfElements);
cudnnStatus_t cudnnBackendGetAttribute(cudnnBackendDescriptor_t descriptor, cudnnBackendAttributeName_t attributeName,
                                       cudnnBackendAttributeType_t attributeType, int64_t requestedElementCount,
                                       int64_t * elementCount, void * arrayOfElements);
cudnnStatus_t cudnnBackendExecute(cudnnHandle_t handle, cudnnBackendDescriptor_t executionPlan,
                                  cudnnBackendDescriptor_t variantPack);

// What the emulation has executed (tests read it): graphs run, and the operations they held.
struct DnnExecutionStats {
    int64_t executions = 0, operations = 0;
};
DnnExecutionStats cudnn_emu_stats();

}  // namespace loom_emu

using namespace loom_emu;

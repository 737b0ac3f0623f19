#pragma once

#include "ggml-backend.h"

#ifdef __cplusplus
extern "C" {
#endif

// CPU_EXACT: matmul kernels whose every output is summed in one order, whatever the batch, the
// thread count or the weights' layout (see exact.cpp). Q4_0, Q8_0, IQ4_NL, Q4_K, Q5_K and Q6_K weights, MUL_MAT and
// MUL_MAT_ID. With ggml_cpu_set_batch_invariant_rows(n > 0) the plain layout of these types is
// computed in the same order too, so a type prints the same text in either layout.
ggml_backend_buffer_type_t ggml_backend_cpu_exact_buffer_type(void);

#ifdef __cplusplus
}
#endif

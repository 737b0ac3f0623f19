#pragma once

#include "ggml-backend.h"

#ifdef __cplusplus
extern "C" {
#endif

// CPU_EXACT: matmul kernels whose every output is summed in one order, whatever the batch, the
// thread count or the weights' layout (see exact.cpp). Q4_0, Q8_0, IQ4_NL, IQ4_XS, MXFP4,
// Q2_K-Q6_K weights (F16/BF16 in place), MUL_MAT and MUL_MAT_ID. With ggml_cpu_set_batch_invariant_rows(n > 0) the plain layout of these types is
// computed in the same order too, so a type prints the same text in either layout.
ggml_backend_buffer_type_t ggml_backend_cpu_exact_buffer_type(void);

// The one-token kernels' variant: how many 16-row groups a thread streams at once (1, 2, 4 or 8)
// and how many bytes ahead it asks for weights (a multiple of 64, at most 16384; 0: none). Every
// variant gives the same bits, only the speed differs (spac times them on the user's CPU).
// Process-wide, like ggml_cpu_set_batch_invariant_rows: set it only while no graph computes.
// False, and nothing changed, for values outside those.
GGML_BACKEND_API bool ggml_cpu_exact_set_variant(int groups, int prefetch_bytes);
GGML_BACKEND_API void ggml_cpu_exact_get_variant(int * groups, int * prefetch_bytes);

#ifdef __cplusplus
}
#endif

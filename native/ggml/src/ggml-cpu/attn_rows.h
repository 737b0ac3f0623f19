#pragma once

#include "ggml.h"

struct ggml_compute_params;

// Batch-invariant flash attention for a few query rows (a decode or a speculative verify pass, in
// batch-invariant mode): each row is computed with exactly the operations of flash attention's
// one-chunk path (every KV position in ascending order, one online softmax per row), so its bits
// are a one-row op's, but the rows that share a KV head walk the cache together: each K and V row
// is read from memory once for up to ATTN_ROWS_MAX query rows instead of once per row.
bool ggml_cpu_flash_attn_rows_supported(const struct ggml_tensor * dst);
void ggml_cpu_flash_attn_rows(const struct ggml_compute_params * params, struct ggml_tensor * dst);

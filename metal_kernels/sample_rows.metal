// sample_rows: logits [R, V], uniforms [R], inv_temperature [], top_k [] -> tokens [R].
// One independent draw per row from p = softmax(x * inv_temperature) over the row's top-k
// tokens, by inverse CDF with the row's uniform (kernels.sample_index), one threadgroup per
// row: the target's choice after every node of a draft tree (tree.target_choices).
DFLASH_THREADGROUP(float, f_partials, kMaxSimdgroups);
DFLASH_THREADGROUP(uint, u_partials, kMaxSimdgroups);
DFLASH_THREADGROUP(metal::atomic_uint, histogram, 16);
DFLASH_THREADGROUP(uint, shared_id, 1);

const Layout tg = make_layout(thread_index_in_threadgroup, threads_per_threadgroup.x,
                              thread_index_in_simdgroup, simdgroup_index_in_threadgroup);
const uint row = threadgroup_position_in_grid.x;
const uint vocab = uint(logits_shape[1]);

auto x = logits + size_t(row) * vocab;
Filter f = top_k_filter(x, vocab, uint(top_k), tg, histogram, u_partials, shared_id);
Softmax sm = softmax_stats(x, vocab, inv_temperature, f, tg, f_partials);
DenseRow<decltype(logits)> no_proposal{logits, false};  // the residual of p against nothing
const uint token = sample_residual(x, vocab, sm, f, no_proposal, uniforms[row], tg, f_partials,
                                   u_partials);
if (tg.tid == 0) {
  tokens[row] = token;
}

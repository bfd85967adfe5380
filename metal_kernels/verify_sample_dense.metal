// verify_sample_dense: logits [B, P, V], drafts [B, L], draft_probs [B, L, V], uniforms [B, P],
// inv_temperature [], top_k [] -> passes [B, P], tokens [B, P] (P = L + 1).
// The lossless rejection step, one threadgroup per (row, position), so a row's positions run
// side by side: draft i passes when uniforms[i] * q_i(d_i) < p_i(d_i); where it does not (and
// at position L, against no proposal: the bonus from p_L) the token is sampled from
// max(p_i - q_i, 0) with uniforms[L]. kernels.verify_sample keeps the drafts up to the first
// that does not pass and emits the token of that position.
DFLASH_THREADGROUP(float, f_partials, kMaxSimdgroups);
DFLASH_THREADGROUP(uint, u_partials, kMaxSimdgroups);
DFLASH_THREADGROUP(metal::atomic_uint, histogram, 16);
DFLASH_THREADGROUP(uint, shared_id, 1);
DFLASH_THREADGROUP(uint, decision, 1);

const Layout tg = make_layout(thread_index_in_threadgroup, threads_per_threadgroup.x,
                              thread_index_in_simdgroup, simdgroup_index_in_threadgroup);
const uint group = threadgroup_position_in_grid.x;  // row * P + position
const uint positions = uint(logits_shape[1]);
const uint vocab = uint(logits_shape[2]);
const uint drafted = positions - 1;
const uint row = group / positions;
const uint pos = group % positions;

auto x = logits + size_t(group) * vocab;
Filter f = top_k_filter(x, vocab, uint(top_k), tg, histogram, u_partials, shared_id);
Softmax sm = softmax_stats(x, vocab, inv_temperature, f, tg, f_partials);
const bool has_draft = pos < drafted;
const size_t q_offset = has_draft ? (size_t(row) * drafted + pos) * vocab : 0;
bool pass = false;
if (has_draft) {
  uint d = uint(drafts[row * drafted + pos]);
  float q = float(draft_probs[q_offset + d]);
  // Every thread branches on it: thread 0 decides for all (threadgroup_decide).
  pass = threadgroup_decide(uniforms[group] * q < target_prob(float(x[d]), d, sm, f), tg,
                            decision);
}
uint token = 0;  // a passing draft's position emits nothing
if (!pass) {
  DenseRow<decltype(draft_probs)> q{draft_probs + q_offset, has_draft};
  token = sample_residual(x, vocab, sm, f, q, uniforms[row * positions + drafted], tg,
                          f_partials, u_partials);
}
if (tg.tid == 0) {
  passes[group] = pass ? 1u : 0u;
  tokens[group] = token;
}

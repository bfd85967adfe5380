// verify_sample_dense: logits [B, L+1, V], drafts [B, L], draft_probs [B, L, V],
// uniforms [B, L+1], inv_temperature [], top_k [] -> accepted_len [B], next_token [B].
// The lossless rejection step, one threadgroup per row: draft i is accepted when
// uniforms[i] * q_i(d_i) < p_i(d_i); at the first rejection (or after all L, against no
// proposal: the bonus from p_L) the token is sampled from max(p_i - q_i, 0) with uniforms[L].
DFLASH_THREADGROUP(float, f_partials, kMaxSimdgroups);
DFLASH_THREADGROUP(uint, u_partials, kMaxSimdgroups);
DFLASH_THREADGROUP(metal::atomic_uint, histogram, 16);
DFLASH_THREADGROUP(uint, shared_id, 1);
DFLASH_THREADGROUP(uint, decision, 1);

const Layout tg = make_layout(thread_index_in_threadgroup, threads_per_threadgroup.x,
                              thread_index_in_simdgroup, simdgroup_index_in_threadgroup);
const uint row = threadgroup_position_in_grid.x;
const uint positions = uint(logits_shape[1]);
const uint vocab = uint(logits_shape[2]);
const uint drafted = positions - 1;
const float u_sample = uniforms[row * positions + drafted];

uint n_accepted = 0;
uint token = 0;
for (uint pos = 0; pos < positions; pos++) {
  auto x = logits + (size_t(row) * positions + pos) * vocab;
  Filter f = top_k_filter(x, vocab, uint(top_k), tg, histogram, u_partials, shared_id);
  Softmax sm = softmax_stats(x, vocab, inv_temperature, f, tg, f_partials);
  const bool has_draft = pos < drafted;
  const size_t q_offset = has_draft ? (size_t(row) * drafted + pos) * vocab : 0;
  if (has_draft) {
    uint d = uint(drafts[row * drafted + pos]);
    float q = float(draft_probs[q_offset + d]);
    // Every thread branches on it: thread 0 decides for all (threadgroup_decide).
    const bool accept = uniforms[row * positions + pos] * q < target_prob(float(x[d]), d, sm, f);
    if (threadgroup_decide(accept, tg, decision)) {
      n_accepted++;
      continue;
    }
  }
  DenseRow<decltype(draft_probs)> q{draft_probs + q_offset, has_draft};
  token = sample_residual(x, vocab, sm, f, q, u_sample, tg, f_partials, u_partials);
  break;
}
if (tg.tid == 0) {
  accepted_len[row] = n_accepted;
  next_token[row] = token;
}

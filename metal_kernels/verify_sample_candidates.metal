// verify_sample_candidates: as verify_sample_dense, with a proposal on K candidates per
// position: cand_ids [B, L, K] (distinct ids), cand_probs [B, L, K], q zero elsewhere (DFlash 2's
// selector walk; a copied draft is K = 1 with probability 1). Template: K.
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
  const size_t q_offset = has_draft ? (size_t(row) * drafted + pos) * K : 0;
  if (has_draft) {
    uint d = uint(drafts[row * drafted + pos]);
    float q = candidate_prob<K>(cand_ids + q_offset, cand_probs + q_offset, d);
    // Every thread branches on it: thread 0 decides for all (threadgroup_decide).
    const bool accept = uniforms[row * positions + pos] * q < target_prob(float(x[d]), d, sm, f);
    if (threadgroup_decide(accept, tg, decision)) {
      n_accepted++;
      continue;
    }
  }
  CandidateRow<K> q = candidate_row<K>(cand_ids + q_offset, cand_probs + q_offset, has_draft,
                                       chunk_of(vocab, tg));
  token = sample_residual(x, vocab, sm, f, q, u_sample, tg, f_partials, u_partials);
  break;
}
if (tg.tid == 0) {
  accepted_len[row] = n_accepted;
  next_token[row] = token;
}

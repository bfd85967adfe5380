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
const size_t q_offset = has_draft ? (size_t(row) * drafted + pos) * K : 0;
bool pass = false;
if (has_draft) {
  uint d = uint(drafts[row * drafted + pos]);
  float q = candidate_prob<K>(cand_ids + q_offset, cand_probs + q_offset, d);
  // Every thread branches on it: thread 0 decides for all (threadgroup_decide).
  pass = threadgroup_decide(uniforms[group] * q < target_prob(float(x[d]), d, sm, f), tg,
                            decision);
}
uint token = 0;  // a passing draft's position emits nothing
if (!pass) {
  CandidateRow<K> q = candidate_row<K>(cand_ids + q_offset, cand_probs + q_offset, has_draft,
                                       chunk_of(vocab, tg));
  token = sample_residual(x, vocab, sm, f, q, uniforms[row * positions + drafted], tg,
                          f_partials, u_partials);
}
if (tg.tid == 0) {
  passes[group] = pass ? 1u : 0u;
  tokens[group] = token;
}

// verify_greedy: logits [B, P, V] -> tokens [B, P]: the argmax of every position (lowest id
// among equal maxima, NaN above all, as mx.argmax), one threadgroup per (row, position), so a
// row's positions run side by side. kernels.verify_greedy compares them with the drafts: the
// first mismatch ends the row, its argmax (or the argmax after the last draft) is emitted.
DFLASH_THREADGROUP(uint, key_partials, kMaxSimdgroups);
DFLASH_THREADGROUP(uint, id_partials, kMaxSimdgroups);

const Layout tg = make_layout(thread_index_in_threadgroup, threads_per_threadgroup.x,
                              thread_index_in_simdgroup, simdgroup_index_in_threadgroup);
const uint group = threadgroup_position_in_grid.x;  // row * P + position
const uint vocab = uint(logits_shape[2]);
const size_t offset = size_t(group) * vocab;

uint best = 0;  // order_key: below every float
uint best_id = kNoIndex;
// Strided (coalesced) reads; ids rise within a thread, so `>` keeps its lowest id.
for (uint i = tg.tid; i < vocab; i += tg.n_threads) {
  uint key = order_key(float(logits[offset + i]));
  if (key > best || best_id == kNoIndex) {
    best = key;
    best_id = i;
  }
}
const uint token = threadgroup_argmax(best, best_id, tg, key_partials, id_partials);
if (tg.tid == 0) {
  tokens[group] = token;
}

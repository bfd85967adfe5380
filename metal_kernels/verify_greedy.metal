// verify_greedy: logits [B, L+1, V], drafts [B, L] -> accepted_len [B], next_token [B].
// One threadgroup per row walks the positions in order: an argmax over the vocabulary by
// threadgroup reduction (lowest id among equal maxima, NaN above all, as mx.argmax), compared
// with the draft.
// The first mismatch ends the row and its argmax is the token to emit; after L matches the
// argmax of position L is (the bonus). Positions after the first mismatch are never read.
DFLASH_THREADGROUP(uint, key_partials, kMaxSimdgroups);
DFLASH_THREADGROUP(uint, id_partials, kMaxSimdgroups);

const Layout tg = make_layout(thread_index_in_threadgroup, threads_per_threadgroup.x,
                              thread_index_in_simdgroup, simdgroup_index_in_threadgroup);
const uint row = threadgroup_position_in_grid.x;
const uint positions = uint(logits_shape[1]);
const uint vocab = uint(logits_shape[2]);
const uint drafted = positions - 1;

uint n_accepted = 0;
uint token = 0;
for (uint pos = 0; pos < positions; pos++) {
  const size_t offset = (size_t(row) * positions + pos) * vocab;
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
  token = threadgroup_argmax(best, best_id, tg, key_partials, id_partials);
  if (pos == drafted || token != uint(drafts[row * drafted + pos])) {
    break;
  }
  n_accepted++;
}
if (tg.tid == 0) {
  accepted_len[row] = n_accepted;
  next_token[row] = token;
}

// path_select_greedy: first [B, K], rest [B, n-1, K, K], n_steps [] -> picks [B, n]: the
// candidate index per position, each the argmax of its scores given the previous pick.
// One simdgroup (32 threads) per row; template: K <= 32.
const uint row = threadgroup_position_in_grid.x;
const uint lane = thread_index_in_simdgroup;
const uint steps = uint(n_steps);

uint pick = 0;
for (uint t = 0; t < steps; t++) {
  pick = simd_argmax(step_score<K>(first, rest, row, steps, t, pick, lane), lane);
  if (lane == 0) {
    picks[row * steps + t] = pick;
  }
}

/*
 * Sessions through the foxedge C ABI: save / restore / load / fork continue bit-identically,
 * bad session files are FX_ERR_BAD_SESSION_FILE (or FX_ERR_IO) and leave the session as it
 * was, and fx_session_feed_batch gives the logits of separate sessions bit for bit, with
 * its error paths.
 *
 * Usage: c_sessions [MODEL_DIR]   (default models/fox-tiny-pro)
 * Prints one line per check and a closing "N passed, M failed"; exits 1 on any failure.
 */
#define _POSIX_C_SOURCE 200809L
#include <foxedge.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int passed, failed;

static void check(int ok, const char *name, const char *detail) {
  if (ok) {
    passed++;
    printf("ok    %s%s%s\n", name, detail ? ": " : "", detail ? detail : "");
  } else {
    failed++;
    printf("FAIL  %s%s%s\n", name, detail ? ": " : "", detail ? detail : "");
  }
}

static void expect(fx_status got, fx_status want, const char *name) {
  char detail[512];
  snprintf(detail, sizeof detail, "%s (%d) want %s (%d): %s", fx_status_string(got), (int)got,
           fx_status_string(want), (int)want, got ? fx_last_error() : "");
  check(got == want && (want == FX_OK || fx_last_error()[0] != '\0'), name, detail);
}

enum { V = 256, N0 = 120, N1 = 40 };

static int32_t ids[N0 + N1];

/* Feeds ids[from, to) one call per `step` tokens; the last call's logits into `out`. */
static fx_status feed_range(fx_session *s, int from, int to, int step, float *out) {
  fx_status st = FX_OK;
  int at;
  for (at = from; at < to && st == FX_OK; at += step) {
    int n = to - at < step ? to - at : step;
    st = fx_session_feed(s, ids + at, (size_t)n, out);
  }
  return st;
}

static size_t state_bytes(const fx_session *s, uint8_t **buf) {
  size_t len = 0;
  if (fx_session_save_buffer(s, NULL, 0, &len) != FX_OK) return 0;
  *buf = malloc(len);
  if (*buf == NULL || fx_session_save_buffer(s, *buf, len, &len) != FX_OK) return 0;
  return len;
}

static void test_save_restore_fork(const fx_model *m, const char *dir) {
  fx_session_options o = fx_session_options_default();
  fx_session *a = NULL, *b = NULL, *c = NULL, *f = NULL;
  float la[V], lb[V], lc[V], lf[V];
  char path[4096], bad[4096];
  uint8_t *bytes = NULL, *again = NULL;
  size_t len, len2, small = 0;
  int i, same = 1;
  FILE *fp;

  o.budget_kind = FX_BUDGET_ENTRIES_PER_HEAD;
  o.budget = 48;
  o.window = 8;
  o.sinks = 2;
  expect(fx_session_new(m, &o, &a), FX_OK, "session_new (budget 48)");
  expect(feed_range(a, 0, N0, 50, la), FX_OK, "feed 120 tokens in chunks");
  snprintf(path, sizeof path, "%s/c_sessions_%d.fxs", dir, (int)getpid());
  snprintf(bad, sizeof bad, "%s/c_sessions_bad_%d.fxs", dir, (int)getpid());
  expect(fx_session_save(a, path), FX_OK, "fx_session_save");
  expect(fx_session_load(m, path, &b), FX_OK, "fx_session_load");
  expect(fx_session_fork(a, &f), FX_OK, "fx_session_fork");
  expect(fx_session_new(m, NULL, &c), FX_OK, "session_new (defaults)");
  expect(feed_range(c, 0, 10, 10, lc), FX_OK, "feed another stream");
  len = state_bytes(a, &bytes);
  check(len > 32, "fx_session_save_buffer size query and write", NULL);
  expect(fx_session_save_buffer(a, bytes, len - 1, &small), FX_ERR_INVALID_ARGUMENT,
         "save_buffer: cap too small");
  check(small == len, "save_buffer reports the size needed", NULL);
  expect(fx_session_restore_buffer(c, bytes, len), FX_OK, "fx_session_restore_buffer");
  for (i = N0; i < N0 + N1; i++) {
    fx_session_feed(a, ids + i, 1, la);
    fx_session_feed(b, ids + i, 1, lb);
    fx_session_feed(c, ids + i, 1, lc);
    fx_session_feed(f, ids + i, 1, lf);
    if (memcmp(la, lb, sizeof la) || memcmp(la, lc, sizeof la) || memcmp(la, lf, sizeof la))
      same = 0;
  }
  check(same, "loaded, restored and forked sessions continue bit-identically", NULL);

  /* Damaged files: the session keeps its state. */
  len2 = state_bytes(c, &again);
  fp = fopen(bad, "wb");
  if (fp) {
    fwrite(bytes, 1, len / 2, fp);
    fclose(fp);
  }
  expect(fx_session_restore(c, bad), FX_ERR_BAD_SESSION_FILE, "restore a truncated file");
  bytes[len / 3] ^= 1;
  expect(fx_session_restore_buffer(c, bytes, len), FX_ERR_BAD_SESSION_FILE,
         "restore a damaged buffer");
  expect(fx_session_restore_buffer(c, (const uint8_t *)"not a session", 13),
         FX_ERR_BAD_SESSION_FILE, "restore something else");
  expect(fx_session_restore(c, "/nonexistent/foxedge.fxs"), FX_ERR_IO, "restore a missing file");
  {
    uint8_t *after = NULL;
    size_t n = state_bytes(c, &after);
    check(n == len2 && after && memcmp(after, again, n) == 0,
          "failed restores leave the session unchanged", NULL);
    free(after);
  }
  expect(fx_session_save(NULL, path), FX_ERR_NULL_POINTER, "save(NULL session)");
  expect(fx_session_save(a, NULL), FX_ERR_NULL_POINTER, "save(NULL path)");
  expect(fx_session_restore_buffer(c, NULL, 3), FX_ERR_NULL_POINTER, "restore_buffer(NULL)");
  {
    fx_session *x = (fx_session *)1;
    expect(fx_session_load(m, bad, &x), FX_ERR_BAD_SESSION_FILE, "load a truncated file");
    check(x == NULL, "failed load leaves *out NULL", NULL);
    x = (fx_session *)1;
    expect(fx_session_fork(NULL, &x), FX_ERR_NULL_POINTER, "fork(NULL)");
    check(x == NULL, "failed fork leaves *out NULL", NULL);
  }
  remove(path);
  remove(bad);
  free(bytes);
  free(again);
  fx_session_free(a);
  fx_session_free(b);
  fx_session_free(c);
  fx_session_free(f);
}

static void test_batch(const fx_model *m) {
  enum { S = 3 };
  fx_session *batch[S], *alone[S];
  const int32_t *lists[S];
  size_t counts[S];
  float got[S * V], want[S * V];
  int i, step, same = 1;

  for (i = 0; i < S; i++) {
    fx_session_options o = fx_session_options_default();
    o.acp = 0;
    o.certified_eviction = 0;
    if (i == 1) o.cache_dtype = FX_CACHE_F16;
    expect(fx_session_new(m, &o, &batch[i]), FX_OK, "session_new (batch)");
    expect(fx_session_new(m, &o, &alone[i]), FX_OK, "session_new (alone)");
  }
  /* Step 0: every session prefills a different length; then mixed steps. */
  for (step = 0; step < 6; step++) {
    for (i = 0; i < S; i++) {
      int from = step == 0 ? 0 : 20 + 5 * step + i;
      size_t n = step == 0 ? (size_t)(10 + 7 * i) : (step % 2 && i == 2 ? 4 : 1);
      lists[i] = ids + from + 30 * i;
      counts[i] = n;
      expect(fx_session_feed(alone[i], lists[i], n, want + i * V), FX_OK, "feed alone");
    }
    expect(fx_session_feed_batch(batch, S, lists, counts, got), FX_OK, "fx_session_feed_batch");
    if (memcmp(got, want, sizeof got)) same = 0;
  }
  /* Decode rows share products summed row by row as a lone step's; chunks run alone. */
  check(same, "batch logits equal separate sessions' bit for bit", NULL);
  {
    fx_session *dup[2] = {batch[0], batch[0]};
    const int32_t *l2[2] = {ids, ids};
    size_t c2[2] = {1, 1};
    int32_t neg = -1;
    const int32_t *ln[1] = {&neg};
    size_t zero[1] = {0};
    fx_session *nul[1] = {NULL};
    expect(fx_session_feed_batch(dup, 2, l2, c2, NULL), FX_ERR_INVALID_ARGUMENT,
           "feed_batch: a handle twice");
    expect(fx_session_feed_batch(batch, 1, ln, c2, NULL), FX_ERR_INVALID_ARGUMENT,
           "feed_batch: negative token");
    expect(fx_session_feed_batch(batch, 1, l2, zero, NULL), FX_ERR_INVALID_ARGUMENT,
           "feed_batch: no tokens");
    expect(fx_session_feed_batch(nul, 1, l2, c2, NULL), FX_ERR_NULL_POINTER,
           "feed_batch: NULL session");
    expect(fx_session_feed_batch(batch, 0, l2, c2, NULL), FX_ERR_INVALID_ARGUMENT,
           "feed_batch: n = 0");
  }
  for (i = 0; i < S; i++) {
    fx_session_free(batch[i]);
    fx_session_free(alone[i]);
  }
}

int main(int argc, char **argv) {
  const char *model_dir = argc > 1 ? argv[1] : "models/fox-tiny-pro";
  const char *tmp = getenv("TMPDIR");
  fx_model *m = NULL;
  unsigned s = 7;
  int i;
  for (i = 0; i < N0 + N1; i++) {
    s = s * 1664525u + 1013904223u;
    ids[i] = (int32_t)((s >> 8) % 256);
  }
  if (fx_model_open(model_dir, NULL, &m) != FX_OK) {
    printf("FAIL  open %s: %s\n", model_dir, fx_last_error());
    return 1;
  }
  test_save_restore_fork(m, tmp && tmp[0] ? tmp : "/tmp");
  test_batch(m);
  fx_model_free(m);
  printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}

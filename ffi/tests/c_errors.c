/*
 * Error paths of the foxedge C ABI. Every bad call must return its status code and leave a
 * message in fx_last_error(), and the process must survive. Also checks one valid
 * fx_attention_forward against a plain double-precision reference written here, and that a
 * failed fx_session_feed leaves the session exactly as it was.
 *
 * Usage: c_errors [MODEL_DIR]   (default models/fox-tiny-pro)
 * Prints one line per check and a closing "N passed, M failed"; exits 1 on any failure.
 */
#define _POSIX_C_SOURCE 200809L
#include <foxedge.h>

#include <math.h>
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

/* A call that must fail with `want` and leave a non-empty message. */
static void expect(fx_status got, fx_status want, const char *name) {
  char detail[512];
  const char *msg = fx_last_error();
  int ok = got == want && msg != NULL && msg[0] != '\0';
  snprintf(detail, sizeof detail, "%s (%d) want %s (%d): %s", fx_status_string(got), (int)got,
           fx_status_string(want), (int)want, msg ? msg : "(null)");
  check(ok, name, detail);
}

static void expect_ok(fx_status got, const char *name) {
  char detail[512];
  snprintf(detail, sizeof detail, "%s%s%s", fx_status_string(got), got ? ": " : "",
           got ? fx_last_error() : "");
  check(got == FX_OK, name, detail);
}

/* ---- fx_version, fx_status_string, fx_acp_threshold ---------------------------------- */

static void test_basics(void) {
  const fx_status codes[] = {FX_OK,
                             FX_ERR_NULL_POINTER,
                             FX_ERR_INVALID_ARGUMENT,
                             FX_ERR_BAD_MODEL,
                             FX_ERR_UNSUPPORTED,
                             FX_ERR_OUT_OF_MEMORY,
                             FX_ERR_BACKEND_UNAVAILABLE,
                             FX_ERR_INTERNAL,
                             FX_ERR_IO,
                             FX_ERR_BOUND_VIOLATED};
  size_t n = sizeof codes / sizeof codes[0], i, j;
  int distinct = 1;
  const char *v = fx_version();
  check(v != NULL && strchr(v, '.') != NULL, "fx_version", v);
  for (i = 0; i < n; i++)
    for (j = i + 1; j < n; j++)
      if (codes[i] == codes[j] || strcmp(fx_status_string(codes[i]), fx_status_string(codes[j])) == 0)
        distinct = 0;
  for (i = 1; i < n; i++)
    if (codes[i] >= 0) distinct = 0;
  check(distinct && codes[0] == 0, "status codes: 0 ok, distinct negative errors, distinct strings",
        NULL);
  check(strcmp(fx_status_string(12345), "unknown status") == 0, "fx_status_string(unknown)",
        fx_status_string(12345));

  {
    float d = fx_acp_threshold(2.0f, 1024, -10.0f);
    float want = (float)(-4.0 - log(1024.0) - 10.0);
    char detail[128];
    snprintf(detail, sizeof detail, "%.6f vs %.6f", d, want);
    check(fabsf(d - want) < 1e-5f, "fx_acp_threshold value", detail);
  }
  {
    float d = fx_acp_threshold(NAN, 10, -10.0f);
    check(isnan(d) && fx_last_error()[0] != '\0', "fx_acp_threshold(NaN bound) -> NaN",
          fx_last_error());
    d = fx_acp_threshold(1.0f, 10, 0.5f);
    check(isnan(d) && fx_last_error()[0] != '\0', "fx_acp_threshold(positive log eps) -> NaN",
          fx_last_error());
    d = fx_acp_threshold(1.0f, 0, -10.0f);
    check(isnan(d) && fx_last_error()[0] != '\0', "fx_acp_threshold(seq_len 0) -> NaN",
          fx_last_error());
    d = fx_acp_threshold(-1.0f, 10, -10.0f);
    check(isnan(d) && fx_last_error()[0] != '\0', "fx_acp_threshold(negative bound) -> NaN",
          fx_last_error());
  }
}

/* ---- fx_attention_forward ------------------------------------------------------------ */

enum { B = 1, HQ = 2, HKV = 1, SQ = 5, SK = 7, HD = 8 };
static float q[B * HQ * SQ * HD], k[B * HKV * SK * HD], v[B * HKV * SK * HD];
static float gates[B * HQ * SK], out[B * HQ * SQ * HD];

static double frand(unsigned *s) {
  *s = *s * 1664525u + 1013904223u;
  return ((*s >> 8) & 0xffff) / 65536.0 * 2.0 - 1.0;
}

static fx_attention_desc small_desc(void) {
  fx_attention_desc d = fx_attention_desc_default();
  d.batch = B;
  d.heads_q = HQ;
  d.heads_kv = HKV;
  d.seq_q = SQ;
  d.seq_k = SK;
  d.head_dim = HD;
  return d;
}

/* Seq-first reference in double: queries are the last SQ of SK positions. */
static double reference_max_err(void) {
  double err = 0.0;
  int h, t, j, c;
  for (h = 0; h < HQ; h++) {
    double cum[SK], acc = 0.0;
    for (j = 0; j < SK; j++) {
      acc += gates[j * HQ + h];
      cum[j] = acc;
    }
    for (t = 0; t < SQ; t++) {
      int i = SK - SQ + t;
      double w[SK], m = -INFINITY, l = 0.0;
      for (j = 0; j <= i; j++) {
        double dot = 0.0;
        for (c = 0; c < HD; c++) dot += (double)q[(t * HQ + h) * HD + c] * k[(j * HKV) * HD + c];
        w[j] = dot / sqrt((double)HD) + cum[i] - cum[j];
        if (w[j] > m) m = w[j];
      }
      for (j = 0; j <= i; j++) l += (w[j] = exp(w[j] - m));
      for (c = 0; c < HD; c++) {
        double o = 0.0, e;
        for (j = 0; j <= i; j++) o += w[j] * v[(j * HKV) * HD + c];
        e = fabs(o / l - out[(t * HQ + h) * HD + c]);
        if (e > err) err = e;
      }
    }
  }
  return err;
}

static void test_attention(void) {
  unsigned seed = 7;
  size_t i;
  fx_attention_desc d;
  fx_attention_stats st;
  for (i = 0; i < sizeof q / sizeof q[0]; i++) q[i] = (float)frand(&seed);
  for (i = 0; i < sizeof k / sizeof k[0]; i++) k[i] = (float)frand(&seed);
  for (i = 0; i < sizeof v / sizeof v[0]; i++) v[i] = (float)frand(&seed);
  for (i = 0; i < sizeof gates / sizeof gates[0]; i++) gates[i] = (float)(-0.5 * (frand(&seed) + 1.0));

  d = small_desc();
  st = fx_attention_stats_default();
  expect_ok(fx_attention_forward(&d, q, k, v, gates, out, &st), "attention: valid f32 call");
  {
    char detail[128];
    double err = reference_max_err();
    snprintf(detail, sizeof detail, "max abs error %.3g vs double reference (tol 1e-5)", err);
    check(err < 1e-5, "attention: output matches reference", detail);
    snprintf(detail, sizeof detail, "kept %llu of %llu pairs", (unsigned long long)st.kept_pairs,
             (unsigned long long)st.total_pairs);
    /* causal pairs per head: sum over i = SK-SQ .. SK-1 of (i + 1) */
    check(st.total_pairs == (uint64_t)HQ * (3 + 4 + 5 + 6 + 7) && st.kept_pairs == st.total_pairs,
          "attention: stats count causal pairs", detail);
  }

  expect(fx_attention_forward(NULL, q, k, v, gates, out, NULL), FX_ERR_NULL_POINTER,
         "attention: NULL desc");
  expect(fx_attention_forward(&d, NULL, k, v, gates, out, NULL), FX_ERR_NULL_POINTER,
         "attention: NULL q");
  expect(fx_attention_forward(&d, q, k, NULL, gates, out, NULL), FX_ERR_NULL_POINTER,
         "attention: NULL v");
  expect(fx_attention_forward(&d, q, k, v, NULL, out, NULL), FX_ERR_NULL_POINTER,
         "attention: NULL log_fgate");
  expect(fx_attention_forward(&d, q, k, v, gates, NULL, NULL), FX_ERR_NULL_POINTER,
         "attention: NULL out");

  d = small_desc();
  d.struct_size = 0;
  expect(fx_attention_forward(&d, q, k, v, gates, out, NULL), FX_ERR_INVALID_ARGUMENT,
         "attention: struct_size 0");
  d.struct_size = sizeof d - 8;
  expect(fx_attention_forward(&d, q, k, v, gates, out, NULL), FX_ERR_INVALID_ARGUMENT,
         "attention: struct_size too small");
  d.struct_size = sizeof d + 64;
  expect(fx_attention_forward(&d, q, k, v, gates, out, NULL), FX_ERR_INVALID_ARGUMENT,
         "attention: struct_size too large");

  d = small_desc();
  d.batch = 0;
  expect(fx_attention_forward(&d, q, k, v, gates, out, NULL), FX_ERR_INVALID_ARGUMENT,
         "attention: batch 0");
  d = small_desc();
  d.seq_q = 0;
  expect(fx_attention_forward(&d, q, k, v, gates, out, NULL), FX_ERR_INVALID_ARGUMENT,
         "attention: seq_q 0");
  d = small_desc();
  d.head_dim = 0;
  expect(fx_attention_forward(&d, q, k, v, gates, out, NULL), FX_ERR_INVALID_ARGUMENT,
         "attention: head_dim 0");
  d = small_desc();
  d.seq_q = SK + 1;
  expect(fx_attention_forward(&d, q, k, v, gates, out, NULL), FX_ERR_INVALID_ARGUMENT,
         "attention: seq_q > seq_k");
  d = small_desc();
  d.heads_kv = 3;
  expect(fx_attention_forward(&d, q, k, v, gates, out, NULL), FX_ERR_INVALID_ARGUMENT,
         "attention: heads_q not a multiple of heads_kv");
  d = small_desc();
  d.block_k = 0;
  expect(fx_attention_forward(&d, q, k, v, gates, out, NULL), FX_ERR_INVALID_ARGUMENT,
         "attention: block_k 0");
  d = small_desc();
  d.batch = (size_t)-1 / 2;
  expect(fx_attention_forward(&d, q, k, v, gates, out, NULL), FX_ERR_INVALID_ARGUMENT,
         "attention: sizes overflow size_t");
  d = small_desc();
  d.layout = 7;
  expect(fx_attention_forward(&d, q, k, v, gates, out, NULL), FX_ERR_INVALID_ARGUMENT,
         "attention: unknown layout");
  d = small_desc();
  d.dtype = -3;
  expect(fx_attention_forward(&d, q, k, v, gates, out, NULL), FX_ERR_INVALID_ARGUMENT,
         "attention: unknown dtype");
  d = small_desc();
  d.backend = 99;
  expect(fx_attention_forward(&d, q, k, v, gates, out, NULL), FX_ERR_INVALID_ARGUMENT,
         "attention: unknown backend");
  d = small_desc();
  d.backend = FX_BACKEND_VULKAN;
  {
    /* Built without Vulkan, or no device: BACKEND_UNAVAILABLE. With a device: a result. */
    fx_status st = fx_attention_forward(&d, q, k, v, gates, out, NULL);
    if (st == FX_OK) {
      char detail[128];
      double err = reference_max_err();
      snprintf(detail, sizeof detail, "ran on Vulkan: max abs error %.3g (tol 1e-5)", err);
      check(err < 1e-5, "attention: vulkan backend", detail);
    } else {
      expect(st, FX_ERR_BACKEND_UNAVAILABLE, "attention: vulkan backend");
    }
  }
  d.backend = FX_BACKEND_HYBRID;
  expect(fx_attention_forward(&d, q, k, v, gates, out, NULL), FX_ERR_BACKEND_UNAVAILABLE,
         "attention: hybrid backend (sessions only)");
  d = small_desc();
  d.sm_scale = NAN;
  expect(fx_attention_forward(&d, q, k, v, gates, out, NULL), FX_ERR_INVALID_ARGUMENT,
         "attention: NaN sm_scale");
  d = small_desc();
  expect(fx_attention_forward(&d, q, k, v, gates, (void *)q, NULL), FX_ERR_INVALID_ARGUMENT,
         "attention: out aliases q");
  expect(fx_attention_forward(&d, (const char *)q + 1, k, v, gates, out, NULL),
         FX_ERR_INVALID_ARGUMENT, "attention: misaligned q");

  d = small_desc();
  d.acp_mode = FX_ACP_THRESHOLD;
  expect(fx_attention_forward(&d, q, k, v, gates, out, NULL), FX_ERR_NULL_POINTER,
         "attention: ACP threshold without values");
  {
    double deltas[B * HQ] = {-5.0, -5.0};
    d.acp_values = deltas;
    d.acp_values_len = 1;
    expect(fx_attention_forward(&d, q, k, v, gates, out, NULL), FX_ERR_INVALID_ARGUMENT,
           "attention: ACP values of the wrong length");
    d.acp_values_len = 2;
    expect_ok(fx_attention_forward(&d, q, k, v, gates, out, NULL), "attention: ACP threshold");
  }
  d = small_desc();
  d.acp_mode = FX_ACP_OBSERVED_NORMS;
  d.log_eps = 1.0f;
  expect(fx_attention_forward(&d, q, k, v, gates, out, NULL), FX_ERR_INVALID_ARGUMENT,
         "attention: positive ACP log eps");
  d.acp_mode = 17;
  expect(fx_attention_forward(&d, q, k, v, gates, out, NULL), FX_ERR_INVALID_ARGUMENT,
         "attention: unknown ACP mode");

  d = small_desc();
  {
    float saved = gates[3];
    gates[3] = NAN;
    expect(fx_attention_forward(&d, q, k, v, gates, out, NULL), FX_ERR_INVALID_ARGUMENT,
           "attention: NaN log gate");
    gates[3] = 0.25f;
    expect(fx_attention_forward(&d, q, k, v, gates, out, NULL), FX_ERR_INVALID_ARGUMENT,
           "attention: positive log gate");
    gates[3] = INFINITY;
    expect(fx_attention_forward(&d, q, k, v, gates, out, NULL), FX_ERR_INVALID_ARGUMENT,
           "attention: infinite log gate");
    gates[3] = saved;
  }
  {
    size_t seq_start[B] = {SK};
    d.seq_start = seq_start;
    expect(fx_attention_forward(&d, q, k, v, gates, out, NULL), FX_ERR_INVALID_ARGUMENT,
           "attention: seq_start >= seq_k");
    d.seq_start = NULL;
  }
  {
    fx_head_stats heads[B * HQ];
    st = fx_attention_stats_default();
    st.struct_size = 3;
    st.kept_pairs = 12345;
    expect(fx_attention_forward(&d, q, k, v, gates, out, &st), FX_ERR_INVALID_ARGUMENT,
           "attention: stats struct_size wrong");
    check(st.kept_pairs == 12345, "attention: failed call leaves stats untouched", NULL);
    st = fx_attention_stats_default();
    st.heads = heads;
    st.heads_len = 1;
    expect(fx_attention_forward(&d, q, k, v, gates, out, &st), FX_ERR_INVALID_ARGUMENT,
           "attention: per-head stats array of the wrong length");
    st.heads_len = B * HQ;
    expect_ok(fx_attention_forward(&d, q, k, v, gates, out, &st), "attention: per-head stats");
    check(heads[0].total_pairs + heads[1].total_pairs == st.total_pairs && isnan(heads[0].delta),
          "attention: per-head stats sum to the totals", NULL);
  }
}

/* ---- models ------------------------------------------------------------------------- */

static int copy_prefix(const char *from, const char *to, long n) {
  FILE *in = fopen(from, "rb"), *out;
  long i;
  int c;
  if (!in) return -1;
  out = fopen(to, "wb");
  if (!out) {
    fclose(in);
    return -1;
  }
  for (i = 0; n < 0 || i < n; i++) {
    if ((c = fgetc(in)) == EOF) break;
    fputc(c, out);
  }
  fclose(in);
  return fclose(out);
}

static long file_size(const char *path) {
  FILE *f = fopen(path, "rb");
  long n;
  if (!f) return -1;
  fseek(f, 0, SEEK_END);
  n = ftell(f);
  fclose(f);
  return n;
}

/* Writes a model dir under `dir` with config.json copied and safetensors cut to `n` bytes
   (n < 0: whole file), then optionally overwrites bytes [at, at+len) with junk. */
static int make_model(const char *src, const char *dir, long n, long at, long len) {
  char a[1024], b[1024];
  snprintf(a, sizeof a, "%s/config.json", src);
  snprintf(b, sizeof b, "%s/config.json", dir);
  if (copy_prefix(a, b, -1)) return -1;
  snprintf(a, sizeof a, "%s/model.safetensors", src);
  snprintf(b, sizeof b, "%s/model.safetensors", dir);
  if (copy_prefix(a, b, n)) return -1;
  if (len > 0) {
    FILE *f = fopen(b, "r+b");
    long i;
    if (!f) return -1;
    fseek(f, at, SEEK_SET);
    for (i = 0; i < len; i++) fputc("}{\x01\xff"[i % 4], f);
    fclose(f);
  }
  return 0;
}

static void remove_model(const char *dir) {
  char p[1024];
  snprintf(p, sizeof p, "%s/config.json", dir);
  remove(p);
  snprintf(p, sizeof p, "%s/model.safetensors", dir);
  remove(p);
}

static fx_model *test_models(const char *model_dir) {
  fx_model *m = (fx_model *)&passed; /* must be reset to NULL by a failing open */
  fx_model_options mo = fx_model_options_default();
  struct fx_model_info info;
  char tmpl[] = "/tmp/foxedge-c-errors-XXXXXX", path[1024];
  char *tmp = mkdtemp(tmpl);
  long size;

  expect(fx_model_open(NULL, NULL, &m), FX_ERR_NULL_POINTER, "model: NULL path");
  check(m == NULL, "model: failed open sets *out = NULL", NULL);
  expect(fx_model_open(model_dir, NULL, NULL), FX_ERR_NULL_POINTER, "model: NULL out");
  expect(fx_model_open("/nonexistent/foxedge/model", NULL, &m), FX_ERR_IO,
         "model: missing directory");
  mo.struct_size = 4;
  expect(fx_model_open(model_dir, &mo, &m), FX_ERR_INVALID_ARGUMENT,
         "model: options struct_size wrong");
  mo = fx_model_options_default();
  mo.flags = 1;
  expect(fx_model_open(model_dir, &mo, &m), FX_ERR_INVALID_ARGUMENT, "model: unknown flags");
  mo = fx_model_options_default();
  mo.weights = 6;
  expect(fx_model_open(model_dir, &mo, &m), FX_ERR_INVALID_ARGUMENT,
         "model: weights not an fx_weight_format");
  mo = fx_model_options_default();
  mo.vocab_weights = -1;
  expect(fx_model_open(model_dir, &mo, &m), FX_ERR_INVALID_ARGUMENT,
         "model: vocab_weights not an fx_weight_format");
  /* Version 1 of the struct (struct_size and flags only) still opens, as stored. */
  mo = fx_model_options_default();
  mo.struct_size = 16;
  mo.weights = FX_WEIGHTS_Q4;
  expect_ok(fx_model_open(model_dir, &mo, &m), "model: version-1 options");
  fx_model_free(m);
  mo = fx_model_options_default();
  mo.weights = FX_WEIGHTS_Q8;
  mo.vocab_weights = FX_WEIGHTS_BF16;
  mo.threads = 2;
  expect_ok(fx_model_open(model_dir, &mo, &m), "model: q8 weights, bf16 vocabulary");
  fx_model_free(m);
  m = (fx_model *)&passed;

  snprintf(path, sizeof path, "%s/model.safetensors", model_dir);
  size = file_size(path);
  check(tmp != NULL && size > 0, "model: temp dir and source model", tmp);
  if (tmp && size > 0) {
    make_model(model_dir, tmp, size / 2, 0, 0);
    expect(fx_model_open(tmp, NULL, &m), FX_ERR_BAD_MODEL, "model: truncated safetensors (half)");
    remove_model(tmp);
    make_model(model_dir, tmp, 5, 0, 0);
    expect(fx_model_open(tmp, NULL, &m), FX_ERR_BAD_MODEL,
           "model: truncated safetensors (5 bytes)");
    remove_model(tmp);
    make_model(model_dir, tmp, -1, 8, 64);
    expect(fx_model_open(tmp, NULL, &m), FX_ERR_BAD_MODEL, "model: corrupt safetensors header");
    remove_model(tmp);
    make_model(model_dir, tmp, -1, 0, 8);
    expect(fx_model_open(tmp, NULL, &m), FX_ERR_BAD_MODEL,
           "model: corrupt safetensors header length");
    remove_model(tmp);
    rmdir(tmp);
  }

  expect_ok(fx_model_open(model_dir, NULL, &m), "model: open the tiny model");
  if (!m) return NULL;
  expect(fx_model_info(NULL, &info), FX_ERR_NULL_POINTER, "model: info of NULL model");
  expect(fx_model_info(m, NULL), FX_ERR_NULL_POINTER, "model: info into NULL");
  info.struct_size = 1;
  expect(fx_model_info(m, &info), FX_ERR_INVALID_ARGUMENT, "model: info struct_size wrong");
  info.struct_size = sizeof info;
  expect_ok(fx_model_info(m, &info), "model: info");
  check(info.vocab_size == 256 && info.n_layers == 4 && info.n_heads == 4 && info.head_dim == 64 &&
            info.hidden_size == 256,
        "model: info matches config.json", NULL);
  return m;
}

/* ---- sessions ----------------------------------------------------------------------- */

static void test_sessions(fx_model *m) {
  fx_session *s = NULL, *t = NULL;
  fx_session_options so = fx_session_options_default();
  struct fx_session_stats st;
  int32_t prompt[] = {0, 'd', 'e', 'f'}, bad[] = {'x', 300}, neg[] = {-1}, next[] = {' '};
  static float la[256], lb[256];

  expect(fx_session_new(NULL, NULL, &s), FX_ERR_NULL_POINTER, "session: NULL model");
  expect(fx_session_new(m, NULL, NULL), FX_ERR_NULL_POINTER, "session: NULL out");
  so.struct_size = sizeof so + 8;
  expect(fx_session_new(m, &so, &s), FX_ERR_INVALID_ARGUMENT, "session: options struct_size wrong");
  so = fx_session_options_default();
  so.budget_kind = FX_BUDGET_ENTRIES_PER_HEAD;
  so.budget = 0;
  expect(fx_session_new(m, &so, &s), FX_ERR_INVALID_ARGUMENT, "session: budget 0");
  so = fx_session_options_default();
  so.budget_kind = 9;
  so.budget = 10;
  expect(fx_session_new(m, &so, &s), FX_ERR_INVALID_ARGUMENT, "session: unknown budget kind");
  so = fx_session_options_default();
  so.backend = 42;
  expect(fx_session_new(m, &so, &s), FX_ERR_INVALID_ARGUMENT, "session: unknown backend");
  so = fx_session_options_default();
  so.log_eps = 3.0;
  expect(fx_session_new(m, &so, &s), FX_ERR_INVALID_ARGUMENT, "session: positive log eps");
  so.log_eps = NAN;
  expect(fx_session_new(m, &so, &s), FX_ERR_INVALID_ARGUMENT, "session: NaN log eps");
  so = fx_session_options_default();
  so.acp = 2;
  expect(fx_session_new(m, &so, &s), FX_ERR_INVALID_ARGUMENT, "session: acp flag not 0/1");
  so = fx_session_options_default();
  so.prefill_chunk = 0;
  expect(fx_session_new(m, &so, &s), FX_ERR_INVALID_ARGUMENT, "session: prefill_chunk 0");

  so = fx_session_options_default();
  expect_ok(fx_session_new(m, &so, &s), "session: new");
  expect_ok(fx_session_new(m, NULL, &t), "session: new with NULL options");
  if (!s || !t) return;

  expect(fx_session_feed(NULL, prompt, 4, NULL), FX_ERR_NULL_POINTER, "feed: NULL session");
  expect(fx_session_feed(s, NULL, 4, NULL), FX_ERR_NULL_POINTER, "feed: NULL tokens");
  expect(fx_session_feed(s, prompt, 0, NULL), FX_ERR_INVALID_ARGUMENT, "feed: zero tokens");

  /* A failed feed must change nothing: s gets failures between the same good feeds as t,
     and both must then give bit-identical logits and counters. */
  expect_ok(fx_session_feed(s, prompt, 4, NULL), "feed: prompt");
  expect_ok(fx_session_feed(t, prompt, 4, NULL), "feed: prompt (twin session)");
  expect(fx_session_feed(s, bad, 2, la), FX_ERR_INVALID_ARGUMENT, "feed: token out of vocabulary");
  expect(fx_session_feed(s, neg, 1, la), FX_ERR_INVALID_ARGUMENT, "feed: negative token");
  expect(fx_session_feed(s, next, 1, (float *)((char *)la + 2)), FX_ERR_INVALID_ARGUMENT,
         "feed: misaligned logits");
  expect_ok(fx_session_feed(s, next, 1, la), "feed: after failures");
  expect_ok(fx_session_feed(t, next, 1, lb), "feed: twin");
  check(memcmp(la, lb, sizeof la) == 0, "feed: failed calls left the session unchanged",
        "logits bit-identical to the twin's");

  {
    float scores[4] = {1.0f, 0.5f, 2.0f, 0.0f};
    fx_session *sc = NULL;
    expect(fx_session_feed_scored(s, prompt, NULL, 4, NULL), FX_ERR_NULL_POINTER,
           "feed_scored: NULL scores");
    expect(fx_session_feed_scored(s, prompt, scores, 4, NULL), FX_ERR_INVALID_ARGUMENT,
           "feed_scored: session created without scored = 1");
    so = fx_session_options_default();
    so.scored = 1;
    so.budget_kind = FX_BUDGET_ENTRIES_PER_HEAD;
    so.budget = 2;
    expect_ok(fx_session_new(m, &so, &sc), "feed_scored: scored session with budget 2");
    expect(fx_session_feed_scored(sc, prompt, scores, 0, NULL), FX_ERR_INVALID_ARGUMENT,
           "feed_scored: zero tokens");
    expect_ok(fx_session_feed_scored(sc, prompt, scores, 4, la), "feed_scored: prompt");
    fx_session_free(sc);
  }

  expect(fx_session_stats(NULL, &st), FX_ERR_NULL_POINTER, "stats: NULL session");
  expect(fx_session_stats(s, NULL), FX_ERR_NULL_POINTER, "stats: NULL out");
  st.struct_size = 0;
  expect(fx_session_stats(s, &st), FX_ERR_INVALID_ARGUMENT, "stats: struct_size wrong");
  st.struct_size = sizeof st;
  expect_ok(fx_session_stats(s, &st), "stats");
  check(st.tokens == 5, "stats: 5 tokens fed (failed feeds not counted)", NULL);
  {
    double bounds[16];
    expect(fx_session_head_bounds(s, bounds, 3), FX_ERR_INVALID_ARGUMENT, "head bounds: wrong n");
    expect(fx_session_head_bounds(s, NULL, 16), FX_ERR_NULL_POINTER, "head bounds: NULL out");
    expect_ok(fx_session_head_bounds(s, bounds, 16), "head bounds");
  }

  expect(fx_session_reset(NULL), FX_ERR_NULL_POINTER, "reset: NULL session");
  expect_ok(fx_session_reset(s), "reset");
  st.struct_size = sizeof st;
  expect_ok(fx_session_stats(s, &st), "stats after reset");
  check(st.tokens == 0, "reset: counters zeroed", NULL);

  fx_session_free(NULL);
  fx_session_free(s);
  /* The model may be freed before its sessions: t keeps what it needs. */
  fx_model_free(m);
  expect_ok(fx_session_feed(t, next, 1, lb), "feed after fx_model_free (session keeps model)");
  fx_session_free(t);
  fx_model_free(NULL);
  check(1, "free: NULL handles are no-ops", NULL);
}

int main(int argc, char **argv) {
  const char *model_dir = argc > 1 ? argv[1] : "models/fox-tiny-pro";
  fx_model *m;
  test_basics();
  test_attention();
  m = test_models(model_dir);
  if (m) test_sessions(m);
  printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}

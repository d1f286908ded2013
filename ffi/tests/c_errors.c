/*
 * Error paths of the foxedge C ABI. Every bad call must return its status code and leave a
 * message in fx_last_error(), and the process must survive. Also checks one valid
 * fx_attention_forward against a plain double-precision reference written here, that a
 * failed fx_session_feed leaves the session exactly as it was, that fx_generate streams the
 * text of the same greedy loop written with fx_sampler_sample, fx_session_feed and
 * fx_detokenize, and that forced evictions report "no guarantee".
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
                             FX_ERR_BOUND_VIOLATED,
                             FX_ERR_BUFFER_TOO_SMALL,
                             FX_ERR_BAD_SESSION_FILE};
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

/* ---- text: tokenizer, sampler, generation ------------------------------------------- */

static void write_file(const char *dir, const char *name, const char *text) {
  char p[1024];
  FILE *f;
  snprintf(p, sizeof p, "%s/%s", dir, name);
  f = fopen(p, "wb");
  if (f) {
    fputs(text, f);
    fclose(f);
  }
}

static void remove_file(const char *dir, const char *name) {
  char p[1024];
  snprintf(p, sizeof p, "%s/%s", dir, name);
  remove(p);
}

/* A model directory whose tokenizer files are damaged still opens and runs on ids; text
   calls fail with FX_ERR_BAD_MODEL naming the file. */
static void test_tokenizer_files(const char *model_dir) {
  char tmpl[] = "/tmp/foxedge-c-tok-XXXXXX";
  char *tmp = mkdtemp(tmpl);
  fx_model *m = NULL;
  fx_session *s = NULL;
  int32_t ids[4], bos[] = {0};
  size_t n = 0;
  fx_tokenizer_info ti;
  if (!tmp || make_model(model_dir, tmp, -1, 0, 0)) {
    check(0, "tokenizer files: temp model", tmp);
    return;
  }
  write_file(tmp, "tokenizer.json", "{\"model\": [");
  expect_ok(fx_model_open(tmp, NULL, &m), "tokenizer files: a damaged tokenizer.json still opens");
  if (m) {
    expect(fx_tokenize(m, "a", 1, 1, ids, 4, &n), FX_ERR_BAD_MODEL,
           "tokenizer files: corrupt tokenizer.json");
    check(strstr(fx_last_error(), "tokenizer.json") != NULL, "tokenizer files: message names it",
          fx_last_error());
    ti.struct_size = sizeof ti;
    expect(fx_model_tokenizer_info(m, &ti), FX_ERR_BAD_MODEL, "tokenizer files: info fails too");
    expect_ok(fx_session_new(m, NULL, &s), "tokenizer files: session");
    expect_ok(fx_session_feed(s, bos, 1, NULL), "tokenizer files: ids still run");
    fx_session_free(s);
    fx_model_free(m);
    m = NULL;
  }
  remove_file(tmp, "tokenizer.json");
  write_file(tmp, "vocab.json", "{\"a\": 0}");
  expect_ok(fx_model_open(tmp, NULL, &m), "tokenizer files: vocab.json alone still opens");
  if (m) {
    expect(fx_tokenize(m, "a", 1, 1, ids, 4, &n), FX_ERR_BAD_MODEL,
           "tokenizer files: vocab.json without merges.txt");
    check(strstr(fx_last_error(), "merges.txt") != NULL, "tokenizer files: message names merges.txt",
          fx_last_error());
    fx_model_free(m);
  }
  remove_file(tmp, "vocab.json");
  remove_model(tmp);
  rmdir(tmp);
}

struct text_buf {
  char text[4096];
  size_t len;
  int calls, bad_nul;
};

static int collect(const char *piece, size_t len, void *user) {
  struct text_buf *b = user;
  b->calls++;
  if (piece[len] != '\0') b->bad_nul = 1;
  if (b->len + len < sizeof b->text) {
    memcpy(b->text + b->len, piece, len);
    b->len += len;
    b->text[b->len] = '\0';
  }
  return 0;
}

static int stop_at_second(const char *piece, size_t len, void *user) {
  int *calls = user;
  (void)piece;
  (void)len;
  return ++*calls >= 2;
}

static void test_tokenize(fx_model *m) {
  fx_tokenizer_info ti;
  int32_t ids[16], hello[] = {0, 'h', 'e', 'l', 'l', 'o'}, bad[] = {'h', 256}, neg[] = {'h', -1};
  size_t n = 99, len = 99;
  char buf[64];

  expect(fx_model_tokenizer_info(NULL, &ti), FX_ERR_NULL_POINTER, "tokenizer info: NULL model");
  expect(fx_model_tokenizer_info(m, NULL), FX_ERR_NULL_POINTER, "tokenizer info: NULL out");
  ti.struct_size = 3;
  expect(fx_model_tokenizer_info(m, &ti), FX_ERR_INVALID_ARGUMENT,
         "tokenizer info: struct_size wrong");
  ti.struct_size = sizeof ti;
  expect_ok(fx_model_tokenizer_info(m, &ti), "tokenizer info");
  check(ti.n_tokens == 256 && ti.bos == 0 && ti.eos == 0 && ti.adds_bos == 1 && !ti.json_escaped,
        "tokenizer info: the byte tokenizer (BOS = EOS = 0, prepended)", NULL);

  expect(fx_tokenize(NULL, "hi", 2, 1, ids, 16, &n), FX_ERR_NULL_POINTER, "tokenize: NULL model");
  expect(fx_tokenize(m, "hi", 2, 1, ids, 16, NULL), FX_ERR_NULL_POINTER, "tokenize: NULL n_ids");
  expect(fx_tokenize(m, NULL, 2, 1, ids, 16, &n), FX_ERR_NULL_POINTER,
         "tokenize: NULL text with a length");
  expect(fx_tokenize(m, "hi", 2, 1, NULL, 16, &n), FX_ERR_NULL_POINTER,
         "tokenize: NULL ids with a capacity");
  expect(fx_tokenize(m, "hi", 2, 2, ids, 16, &n), FX_ERR_INVALID_ARGUMENT,
         "tokenize: add_bos not 0 or 1");
  expect(fx_tokenize(m, "a\xff\xfe", 3, 1, ids, 16, &n), FX_ERR_INVALID_ARGUMENT,
         "tokenize: text not UTF-8");
  ids[0] = -7;
  n = 0;
  expect(fx_tokenize(m, "hello", 5, 1, ids, 3, &n), FX_ERR_BUFFER_TOO_SMALL,
         "tokenize: buffer too small");
  check(n == 6 && ids[0] == -7, "tokenize: too small writes the count needed (6), no ids", NULL);
  n = 0;
  expect(fx_tokenize(m, "hello", 5, 1, NULL, 0, &n), FX_ERR_BUFFER_TOO_SMALL,
         "tokenize: size query (NULL, 0)");
  check(n == 6, "tokenize: size query gives 6", NULL);
  expect_ok(fx_tokenize(m, "hello", 5, 1, ids, 6, &n), "tokenize: exact capacity");
  check(n == 6 && memcmp(ids, hello, sizeof hello) == 0, "tokenize: BOS then the bytes", NULL);
  expect_ok(fx_tokenize(m, "a\0b", 3, 0, ids, 16, &n), "tokenize: no BOS, a NUL inside");
  check(n == 3 && ids[0] == 'a' && ids[1] == 0 && ids[2] == 'b', "tokenize: 3 ids", NULL);
  expect_ok(fx_tokenize(m, NULL, 0, 0, NULL, 0, &n), "tokenize: empty text, no BOS");
  check(n == 0, "tokenize: no ids", NULL);

  expect(fx_detokenize(NULL, hello, 6, 0, buf, sizeof buf, &len), FX_ERR_NULL_POINTER,
         "detokenize: NULL model");
  expect(fx_detokenize(m, NULL, 6, 0, buf, sizeof buf, &len), FX_ERR_NULL_POINTER,
         "detokenize: NULL ids");
  expect(fx_detokenize(m, hello, 6, 0, NULL, sizeof buf, &len), FX_ERR_NULL_POINTER,
         "detokenize: NULL text with a capacity");
  expect(fx_detokenize(m, hello, 6, 0, buf, sizeof buf, NULL), FX_ERR_NULL_POINTER,
         "detokenize: NULL text_len");
  expect(fx_detokenize(m, bad, 2, 0, buf, sizeof buf, &len), FX_ERR_INVALID_ARGUMENT,
         "detokenize: id 256 outside the vocabulary");
  check(strstr(fx_last_error(), "256") != NULL, "detokenize: message names the id",
        fx_last_error());
  expect(fx_detokenize(m, neg, 2, 0, buf, sizeof buf, &len), FX_ERR_INVALID_ARGUMENT,
         "detokenize: negative id");
  check(strstr(fx_last_error(), "ids[1]") != NULL, "detokenize: message names the index",
        fx_last_error());
  expect(fx_detokenize(m, hello, 6, 2, buf, sizeof buf, &len), FX_ERR_INVALID_ARGUMENT,
         "detokenize: skip_special not 0 or 1");
  memset(buf, 'Z', sizeof buf);
  len = 0;
  expect(fx_detokenize(m, hello, 6, 1, buf, 5, &len), FX_ERR_BUFFER_TOO_SMALL,
         "detokenize: no room for the NUL");
  check(len == 5 && buf[0] == 'Z', "detokenize: too small writes the length (5), no text", NULL);
  expect(fx_detokenize(m, hello, 6, 1, NULL, 0, &len), FX_ERR_BUFFER_TOO_SMALL,
         "detokenize: size query (NULL, 0)");
  expect_ok(fx_detokenize(m, hello, 6, 1, buf, 6, &len), "detokenize: skip special");
  check(len == 5 && strcmp(buf, "hello") == 0, "detokenize: \"hello\" and a NUL", buf);
  expect_ok(fx_detokenize(m, hello, 6, 0, buf, sizeof buf, &len), "detokenize: with BOS");
  check(len == 6 && buf[0] == '\0' && memcmp(buf + 1, "hello", 6) == 0,
        "detokenize: BOS is byte 0 as text", NULL);
  expect_ok(fx_detokenize(m, NULL, 0, 0, buf, 1, &len), "detokenize: no ids");
  check(len == 0 && buf[0] == '\0', "detokenize: empty text", NULL);
}

static void test_sampler(void) {
  fx_sampler *sp = (fx_sampler *)&passed, *g = NULL, *r = NULL, *a = NULL, *b = NULL;
  fx_sampler_params p;
  float logits[4] = {0.0f, 3.0f, 1.0f, 3.0f}, nanl[2] = {0.0f, NAN};
  int32_t tok = -1, nine[] = {9}, neg[] = {-3};
  int i, same = 1;
  struct {
    const char *name;
    float t, top_p, min_p, rep;
  } bad[] = {{"sampler: negative temperature", -1.0f, 1.0f, 0.0f, 1.0f},
             {"sampler: NaN temperature", NAN, 1.0f, 0.0f, 1.0f},
             {"sampler: top_p 0", 1.0f, 0.0f, 0.0f, 1.0f},
             {"sampler: top_p > 1", 1.0f, 1.5f, 0.0f, 1.0f},
             {"sampler: min_p > 1", 1.0f, 1.0f, 2.0f, 1.0f},
             {"sampler: repetition penalty 0", 1.0f, 1.0f, 0.0f, 0.0f},
             {"sampler: infinite repetition penalty", 1.0f, 1.0f, 0.0f, INFINITY}};

  for (i = 0; i < (int)(sizeof bad / sizeof bad[0]); i++) {
    p = fx_sampler_params_default();
    p.temperature = bad[i].t;
    p.top_p = bad[i].top_p;
    p.min_p = bad[i].min_p;
    p.repetition_penalty = bad[i].rep;
    expect(fx_sampler_new(&p, &sp), FX_ERR_INVALID_ARGUMENT, bad[i].name);
    check(sp == NULL, "sampler: failed new sets *out = NULL", NULL);
  }
  p = fx_sampler_params_default();
  p.struct_size = 2;
  expect(fx_sampler_new(&p, &sp), FX_ERR_INVALID_ARGUMENT, "sampler: struct_size wrong");
  expect(fx_sampler_new(NULL, NULL), FX_ERR_NULL_POINTER, "sampler: NULL out");
  p = fx_sampler_params_default();
  p.temperature = 0.0f;
  expect_ok(fx_sampler_new(&p, &g), "sampler: greedy");
  if (!g) return;
  expect(fx_sampler_sample(NULL, logits, 4, &tok), FX_ERR_NULL_POINTER, "sample: NULL sampler");
  expect(fx_sampler_sample(g, NULL, 4, &tok), FX_ERR_NULL_POINTER, "sample: NULL logits");
  expect(fx_sampler_sample(g, logits, 4, NULL), FX_ERR_NULL_POINTER, "sample: NULL token_out");
  expect(fx_sampler_sample(g, logits, 0, &tok), FX_ERR_INVALID_ARGUMENT, "sample: n = 0");
  expect(fx_sampler_sample(g, nanl, 2, &tok), FX_ERR_INVALID_ARGUMENT, "sample: NaN logit");
  check(strstr(fx_last_error(), "logit 1") != NULL, "sample: message names the logit",
        fx_last_error());
  expect_ok(fx_sampler_sample(g, logits, 4, &tok), "sample: greedy");
  check(tok == 1, "sample: greedy takes the argmax, lowest id on ties", NULL);
  expect(fx_sampler_accept(NULL, nine, 1), FX_ERR_NULL_POINTER, "accept: NULL sampler");
  expect(fx_sampler_accept(g, NULL, 1), FX_ERR_NULL_POINTER, "accept: NULL tokens");
  expect(fx_sampler_accept(g, neg, 1), FX_ERR_INVALID_ARGUMENT, "accept: negative token");
  expect_ok(fx_sampler_accept(g, NULL, 0), "accept: nothing");

  p = fx_sampler_params_default();
  p.repetition_penalty = 1.3f;
  expect_ok(fx_sampler_new(&p, &r), "sampler: with a repetition penalty");
  if (r) {
    expect_ok(fx_sampler_accept(r, nine, 1), "accept: token 9");
    expect(fx_sampler_sample(r, logits, 4, &tok), FX_ERR_INVALID_ARGUMENT,
           "sample: a recent token outside the logits");
    expect(fx_sampler_reset(NULL), FX_ERR_NULL_POINTER, "sampler reset: NULL");
    expect_ok(fx_sampler_reset(r), "sampler reset");
    expect_ok(fx_sampler_sample(r, logits, 4, &tok), "sample: after reset");
  }

  p = fx_sampler_params_default();
  p.seed = 77;
  p.top_k = 3;
  expect_ok(fx_sampler_new(&p, &a), "sampler: seeded a");
  expect_ok(fx_sampler_new(&p, &b), "sampler: seeded b");
  if (a && b) {
    for (i = 0; i < 20; i++) {
      int32_t ta = -1, tb = -2;
      if (fx_sampler_sample(a, logits, 4, &ta) || fx_sampler_sample(b, logits, 4, &tb) || ta != tb ||
          ta == 0)
        same = 0;
    }
    check(same, "sample: equal seeds draw equal tokens, top-k 3 never draws the least likely",
          NULL);
  }
  fx_sampler_free(a);
  fx_sampler_free(b);
  fx_sampler_free(r);
  fx_sampler_free(g);
  fx_sampler_free(NULL);
}

static void test_generate(fx_model *m) {
  fx_session *s = NULL, *t = NULL;
  fx_sampler *g = NULL;
  fx_sampler_params p = fx_sampler_params_default();
  fx_generate_options o = fx_generate_options_default();
  fx_generate_result res;
  struct fx_session_stats st;
  struct text_buf tb, cut;
  const char *prompt = "def f(x):\n", *empty_stop[] = {""}, *null_stop[] = {NULL};
  const char *stops[2];
  char stop[4];
  int calls = 0;
  int32_t ids[64], next;
  size_t n = 0, len = 0, i;
  static float logits[256];
  char text[256];

  p.temperature = 0.0f;
  expect_ok(fx_sampler_new(&p, &g), "generate: greedy sampler");
  expect_ok(fx_session_new(m, NULL, &s), "generate: session");
  if (!g || !s) return;
  memset(&tb, 0, sizeof tb);
  res.struct_size = sizeof res;
  expect(fx_generate(NULL, g, "a", 1, NULL, collect, &tb, &res), FX_ERR_NULL_POINTER,
         "generate: NULL session");
  expect(fx_generate(s, NULL, "a", 1, NULL, collect, &tb, &res), FX_ERR_NULL_POINTER,
         "generate: NULL sampler");
  expect(fx_generate(s, g, "a", 1, NULL, NULL, &tb, &res), FX_ERR_NULL_POINTER,
         "generate: NULL callback");
  expect(fx_generate(s, g, NULL, 1, NULL, collect, &tb, &res), FX_ERR_NULL_POINTER,
         "generate: NULL prompt with a length");
  expect(fx_generate(s, g, "\xc3", 1, NULL, collect, &tb, &res), FX_ERR_INVALID_ARGUMENT,
         "generate: prompt not UTF-8");
  o.stop_at_eos = 5;
  expect(fx_generate(s, g, "a", 1, &o, collect, &tb, &res), FX_ERR_INVALID_ARGUMENT,
         "generate: stop_at_eos not 0 or 1");
  o = fx_generate_options_default();
  o.n_stop = 1;
  expect(fx_generate(s, g, "a", 1, &o, collect, &tb, &res), FX_ERR_NULL_POINTER,
         "generate: NULL stop array");
  o.stop = null_stop;
  expect(fx_generate(s, g, "a", 1, &o, collect, &tb, &res), FX_ERR_NULL_POINTER,
         "generate: NULL stop string");
  o.stop = empty_stop;
  expect(fx_generate(s, g, "a", 1, &o, collect, &tb, &res), FX_ERR_INVALID_ARGUMENT,
         "generate: empty stop string");
  o = fx_generate_options_default();
  o.struct_size = 1;
  expect(fx_generate(s, g, "a", 1, &o, collect, &tb, &res), FX_ERR_INVALID_ARGUMENT,
         "generate: options struct_size wrong");
  res.struct_size = 2;
  expect(fx_generate(s, g, "a", 1, NULL, collect, &tb, &res), FX_ERR_INVALID_ARGUMENT,
         "generate: result struct_size wrong");
  res.struct_size = sizeof res;
  st.struct_size = sizeof st;
  expect_ok(fx_session_stats(s, &st), "generate: stats");
  check(st.tokens == 0 && tb.calls == 0, "generate: failed calls fed nothing, called nothing",
        NULL);

  /* Greedy generation equals the same loop written with the other functions. */
  o = fx_generate_options_default();
  o.max_tokens = 24;
  o.stop_at_eos = 0;
  expect_ok(fx_generate(s, g, prompt, strlen(prompt), &o, collect, &tb, &res), "generate: greedy");
  check(res.stop_reason == FX_STOP_MAX_TOKENS && res.n_tokens == 24 && res.stop_index == -1 &&
            res.n_prompt_tokens == strlen(prompt) + 1,
        "generate: 24 tokens after a prompt of BOS + bytes", NULL);
  check(!tb.bad_nul && tb.calls > 0, "generate: pieces are NUL-terminated", NULL);
  expect_ok(fx_session_new(m, NULL, &t), "generate: twin session");
  expect_ok(fx_tokenize(m, prompt, strlen(prompt), 1, ids, 64, &n), "generate: twin prompt");
  expect_ok(fx_session_feed(t, ids, n, logits), "generate: twin prefill");
  for (i = 0; i < 24; i++) {
    if (fx_sampler_sample(g, logits, 256, &next) || fx_session_feed(t, &next, 1, logits)) break;
    ids[i] = next;
  }
  expect_ok(fx_detokenize(m, ids, 24, 1, text, sizeof text, &len), "generate: twin text");
  check(len == tb.len && memcmp(text, tb.text, len) == 0,
        "generate: the streamed text is the greedy loop's", tb.text);
  expect_ok(fx_session_stats(s, &st), "generate: stats after");
  check(st.tokens == strlen(prompt) + 1 + 24, "generate: the session holds prompt and tokens",
        NULL);
  check(st.bound_holds == 1 && st.max_bound < 1.0, "stats: a certified bound below 1", NULL);

  /* A continuation: no BOS on a session that has tokens; an empty prompt has no tokens. */
  memset(&cut, 0, sizeof cut);
  o.max_tokens = 2;
  expect_ok(fx_generate(s, g, "x", 1, &o, collect, &cut, &res), "generate: continuation");
  check(res.n_prompt_tokens == 1, "generate: a continuation gets no BOS", NULL);
  expect(fx_generate(s, g, "", 0, &o, collect, &cut, &res), FX_ERR_INVALID_ARGUMENT,
         "generate: empty continuation prompt");

  /* A stop string from the middle of the text ends it there, not printed. */
  if (tb.len >= 8) {
    memcpy(stop, tb.text + 4, 3);
    stop[3] = '\0';
    stops[0] = "\x01never";
    stops[1] = stop;
    o = fx_generate_options_default();
    o.max_tokens = 24;
    o.stop_at_eos = 0;
    o.stop = stops;
    o.n_stop = 2;
    memset(&cut, 0, sizeof cut);
    expect_ok(fx_session_reset(s), "generate: reset");
    expect_ok(fx_generate(s, g, prompt, strlen(prompt), &o, collect, &cut, &res),
              "generate: with stop strings");
    check(res.stop_reason == FX_STOP_STRING && res.stop_index == 1,
          "generate: stopped at stop string 1", NULL);
    check(cut.len == (size_t)(strstr(tb.text, stop) - tb.text) &&
              memcmp(cut.text, tb.text, cut.len) == 0,
          "generate: the text ends where the stop string starts", cut.text);
  }

  /* A callback that returns non-zero stops the generation (not an error). */
  expect_ok(fx_session_reset(s), "generate: reset");
  o = fx_generate_options_default();
  o.max_tokens = 40;
  expect_ok(fx_generate(s, g, prompt, strlen(prompt), &o, stop_at_second, &calls, &res),
            "generate: a callback that stops");
  check(res.stop_reason == FX_STOP_CALLBACK && calls == 2 && res.n_tokens < 40,
        "generate: stopped by the callback", NULL);
  expect_ok(fx_session_stats(s, &st), "generate: stats after the callback stopped");
  check(st.tokens == res.n_prompt_tokens + res.n_tokens,
        "generate: the session holds every token passed to the callback", NULL);
  expect_ok(fx_generate(s, g, "y", 1, &o, stop_at_second, &calls, NULL),
            "generate: NULL result is allowed");

  fx_session_free(t);
  fx_session_free(s);
  fx_sampler_free(g);
}

/* Honest statistics: a budget that forces evictions far past the certificate reports
   "no guarantee" (flag 0, bound 1, per-head bounds 1) instead of a huge number. */
static void test_no_guarantee(fx_model *m) {
  fx_session *s = NULL;
  fx_session_options so = fx_session_options_default();
  struct fx_session_stats st;
  int32_t ids[300];
  double bounds[16];
  int i, ones = 0;
  so.budget_kind = FX_BUDGET_ENTRIES_PER_HEAD;
  so.budget = 4;
  so.window = 2;
  so.n_threads = 1;
  expect_ok(fx_session_new(m, &so, &s), "no guarantee: session with budget 4, 1 thread");
  if (!s) return;
  for (i = 0; i < 300; i++) ids[i] = i == 0 ? 0 : 'a' + i % 26;
  expect_ok(fx_session_feed(s, ids, 300, NULL), "no guarantee: feed 300 tokens");
  st.struct_size = sizeof st;
  expect_ok(fx_session_stats(s, &st), "no guarantee: stats");
  check(st.evicted_forced > 0 && st.bound_holds == 0 && st.max_bound == 1.0,
        "no guarantee: forced evictions past the bound report no guarantee", NULL);
  expect_ok(fx_session_head_bounds(s, bounds, 16), "no guarantee: head bounds");
  for (i = 0; i < 16; i++) ones += bounds[i] == 1.0;
  check(ones > 0, "no guarantee: heads without a guarantee report 1", NULL);
  fx_session_free(s);
  so = fx_session_options_default();
  so.n_threads = 5000;
  expect(fx_session_new(m, &so, &s), FX_ERR_INVALID_ARGUMENT, "session: n_threads too large");
}

int main(int argc, char **argv) {
  const char *model_dir = argc > 1 ? argv[1] : "models/fox-tiny-pro";
  fx_model *m;
  test_basics();
  test_attention();
  test_sampler();
  test_tokenizer_files(model_dir);
  m = test_models(model_dir);
  if (m) {
    test_tokenize(m);
    test_generate(m);
    test_no_guarantee(m);
    test_sessions(m);
  }
  printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}

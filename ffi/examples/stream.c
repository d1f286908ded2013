/*
 * Streaming with the foxedge C ABI: open the tiny FoX model, feed a prompt (byte tokens,
 * BOS = 0), decode greedy tokens under a cache budget, print the text and the session's
 * statistics.
 *
 * Build (after `bash ffi/scripts/ci.sh` staged the library and foxedge.pc):
 *   gcc -std=c11 ffi/examples/stream.c $(pkg-config --cflags --libs foxedge) -o stream
 * Run:
 *   ./stream [MODEL_DIR] [N_TOKENS] [BACKEND]   (defaults: models/fox-tiny-pro, 96, cpu;
 *                                                BACKEND: cpu, vulkan, auto or hybrid)
 */
#include <foxedge.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(call)                                                                      \
  do {                                                                                   \
    fx_status st_ = (call);                                                              \
    if (st_ != FX_OK) {                                                                  \
      fprintf(stderr, "%s failed: %s (%d): %s\n", #call, fx_status_string(st_), (int)st_, \
              fx_last_error());                                                          \
      return 1;                                                                          \
    }                                                                                    \
  } while (0)

static int32_t argmax(const float *x, size_t n) {
  size_t i, best = 0;
  for (i = 1; i < n; i++)
    if (x[i] > x[best]) best = i;
  return (int32_t)best;
}

int main(int argc, char **argv) {
  const char *dir = argc > 1 ? argv[1] : "models/fox-tiny-pro";
  long n_gen = argc > 2 ? strtol(argv[2], NULL, 10) : 96;
  const char *backend = argc > 3 ? argv[3] : "cpu";
  const char *text = "import os\nimport sys\n\n\ndef main(argv):\n    ";
  fx_model *model = NULL;
  fx_session *session = NULL;
  struct fx_model_info info;
  fx_session_options opts = fx_session_options_default();
  struct fx_session_stats st;
  int32_t *prompt;
  float *logits;
  size_t n_prompt = strlen(text) + 1, i;
  long t;

  printf("foxedge %s\n", fx_version());
  CHECK(fx_model_open(dir, NULL, &model));
  info.struct_size = sizeof info;
  CHECK(fx_model_info(model, &info));
  printf("model %s: vocab %zu, %zu layers, %zu heads x %zu, hidden %zu, %llu params\n", dir,
         info.vocab_size, info.n_layers, info.n_heads, info.head_dim, info.hidden_size,
         (unsigned long long)info.n_params);

  /* A budget well below the stream length so eviction runs; the protected window keeps the
     recent tokens, the certificate reports what eviction may cost. */
  if (strcmp(backend, "cpu") == 0)
    opts.backend = FX_BACKEND_CPU;
  else if (strcmp(backend, "vulkan") == 0)
    opts.backend = FX_BACKEND_VULKAN;
  else if (strcmp(backend, "auto") == 0)
    opts.backend = FX_BACKEND_AUTO;
  else if (strcmp(backend, "hybrid") == 0)
    opts.backend = FX_BACKEND_HYBRID;
  else {
    fprintf(stderr, "unknown backend %s (cpu, vulkan, auto, hybrid)\n", backend);
    return 2;
  }
  opts.budget_kind = FX_BUDGET_ENTRIES_PER_HEAD;
  opts.budget = 64;
  opts.window = 16;
  opts.sinks = 1;
  CHECK(fx_session_new(model, &opts, &session));

  prompt = malloc(n_prompt * sizeof *prompt);
  logits = malloc(info.vocab_size * sizeof *logits);
  if (!prompt || !logits) return 1;
  prompt[0] = 0; /* BOS */
  for (i = 1; i < n_prompt; i++) prompt[i] = (unsigned char)text[i - 1];

  CHECK(fx_session_feed(session, prompt, n_prompt, logits));
  printf("---- prompt + %ld greedy tokens on %s (budget %llu entries per head)\n%s", n_gen,
         backend, (unsigned long long)opts.budget, text);
  for (t = 0; t < n_gen; t++) {
    int32_t next = argmax(logits, info.vocab_size);
    putchar(next >= 32 && next < 127 ? next : (next == '\n' ? '\n' : '?'));
    CHECK(fx_session_feed(session, &next, 1, logits));
  }
  printf("\n----\n");

  st.struct_size = sizeof st;
  CHECK(fx_session_stats(session, &st));
  printf("tokens           %llu (prefill %llu, decode %llu)\n", (unsigned long long)st.tokens,
         (unsigned long long)st.prefill_tokens, (unsigned long long)st.decode_tokens);
  printf("prefill          %.1f tokens/s\n",
         st.prefill_seconds > 0 ? st.prefill_tokens / st.prefill_seconds : 0.0);
  printf("decode           %.1f tokens/s\n",
         st.decode_seconds > 0 ? st.decode_tokens / st.decode_seconds : 0.0);
  printf("cache            %llu live entries, %llu bytes (peak %llu)\n",
         (unsigned long long)st.live_entries, (unsigned long long)st.cache_bytes,
         (unsigned long long)st.peak_cache_bytes);
  printf("evicted          %llu certified, %llu forced by the budget\n",
         (unsigned long long)st.evicted_certified, (unsigned long long)st.evicted_forced);
  printf("attention pairs  %llu kept of %llu (%.1f%% pruned)\n", (unsigned long long)st.kept_pairs,
         (unsigned long long)st.total_pairs,
         st.total_pairs ? 100.0 * (1.0 - (double)st.kept_pairs / (double)st.total_pairs) : 0.0);
  printf("eviction bound   max B_t = %.3g (attention mass evicted entries can take)\n",
         st.max_bound);

  fx_session_free(session);
  fx_model_free(model);
  free(prompt);
  free(logits);
  return 0;
}

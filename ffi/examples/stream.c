/*
 * Text generation with the foxedge C ABI: open a FoX model directory (its tokenizer comes
 * with it), tokenize a prompt, make a sampler, stream the generated text through a callback
 * under a cache budget, and print the session's statistics.
 *
 * Build (after `bash ffi/scripts/ci.sh` staged the library and foxedge.pc):
 *   gcc -std=c11 ffi/examples/stream.c $(pkg-config --cflags --libs foxedge) -o stream
 * Run:
 *   ./stream [MODEL_DIR] [PROMPT] [MAX_TOKENS] [BACKEND] [THREADS]
 *     defaults: models/fox-tiny-pro, the start of a Python file, 96, cpu, 0 (all cores);
 *     BACKEND: cpu, vulkan, auto or hybrid.
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

/* The callback: print each piece as it comes, and count the bytes. */
static int print_piece(const char *piece, size_t len, void *user) {
  size_t *bytes = user;
  fwrite(piece, 1, len, stdout);
  fflush(stdout);
  *bytes += len;
  return 0; /* non-zero would stop the generation */
}

int main(int argc, char **argv) {
  const char *dir = argc > 1 ? argv[1] : "models/fox-tiny-pro";
  const char *text = argc > 2 ? argv[2] : "import os\nimport sys\n\n\ndef main(argv):\n    ";
  long max_tokens = argc > 3 ? strtol(argv[3], NULL, 10) : 96;
  const char *backend = argc > 4 ? argv[4] : "cpu";
  long threads = argc > 5 ? strtol(argv[5], NULL, 10) : 0;
  /* Stop before the model starts a new top-level definition. */
  const char *stops[] = {"\nclass ", "\nif __name__"};
  fx_model *model = NULL;
  fx_session *session = NULL;
  fx_sampler *sampler = NULL;
  struct fx_model_info info;
  fx_tokenizer_info tinfo;
  fx_session_options opts = fx_session_options_default();
  fx_sampler_params params = fx_sampler_params_default();
  fx_generate_options gopts = fx_generate_options_default();
  fx_generate_result result;
  struct fx_session_stats st;
  size_t n_prompt = 0, bytes = 0;
  static const char *reasons[] = {"end of text", "stop string", "max tokens", "callback"};

  if (max_tokens < 0 || threads < 0) {
    fprintf(stderr, "MAX_TOKENS and THREADS must be >= 0\n");
    return 2;
  }
  printf("foxedge %s\n", fx_version());
  CHECK(fx_model_open(dir, NULL, &model));
  info.struct_size = sizeof info;
  CHECK(fx_model_info(model, &info));
  tinfo.struct_size = sizeof tinfo;
  CHECK(fx_model_tokenizer_info(model, &tinfo));
  printf("model %s: vocab %zu, %zu layers, %zu heads x %zu, hidden %zu, %llu params\n", dir,
         info.vocab_size, info.n_layers, info.n_heads, info.head_dim, info.hidden_size,
         (unsigned long long)info.n_params);
  printf("tokenizer: %zu tokens, BOS %d (%s), EOS %d%s\n", tinfo.n_tokens, (int)tinfo.bos,
         tinfo.adds_bos ? "prepended" : "not prepended", (int)tinfo.eos,
         tinfo.json_escaped ? ", JSON-escaped text" : "");
  /* A size query: no buffer; the count comes back with FX_ERR_BUFFER_TOO_SMALL. */
  {
    fx_status q = fx_tokenize(model, text, strlen(text), 1, NULL, 0, &n_prompt);
    if (q != FX_OK && q != FX_ERR_BUFFER_TOO_SMALL) {
      fprintf(stderr, "fx_tokenize failed: %s\n", fx_last_error());
      return 1;
    }
  }
  printf("prompt: %zu bytes, %zu tokens\n", strlen(text), n_prompt);

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
  opts.n_threads = (size_t)threads;
  CHECK(fx_session_new(model, &opts, &session));

  params.temperature = 0.7f;
  params.top_k = 40;
  params.top_p = 0.95f;
  params.repetition_penalty = 1.1f;
  params.seed = 42;
  CHECK(fx_sampler_new(&params, &sampler));

  gopts.max_tokens = (size_t)max_tokens;
  gopts.stop = stops;
  gopts.n_stop = sizeof stops / sizeof stops[0];
  result.struct_size = sizeof result;
  printf("---- prompt + up to %ld sampled tokens on %s (budget %llu entries per head)\n%s",
         max_tokens, backend, (unsigned long long)opts.budget, text);
  fflush(stdout);
  CHECK(fx_generate(session, sampler, text, strlen(text), &gopts, print_piece, &bytes, &result));
  printf("\n----\n");
  printf("generated        %zu tokens, %zu bytes of text; stopped at %s\n", result.n_tokens,
         bytes, reasons[result.stop_reason & 3]);

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
  if (st.bound_holds)
    printf("eviction bound   max B_t = %.3g (attention mass evicted entries can take)\n",
           st.max_bound);
  else
    printf("eviction bound   no guarantee (forced evictions went past the certificate)\n");

  fx_sampler_free(sampler);
  fx_session_free(session);
  fx_model_free(model);
  return 0;
}

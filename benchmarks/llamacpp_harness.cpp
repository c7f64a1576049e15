// llama.cpp side of benchmarks/bench_llamacpp.py, through llama.cpp's public C API (llama.h) only, so
// that it links against libllama without the tools' common library: decode and prefill timings with
// per-step CPU time, perplexity on given token ids, an importance matrix on given token ids, and
// quantization (llama_model_quantize, what llama-quantize calls) with or without that matrix.
//
// Build (bench_llamacpp.py does it): g++ -O2 -std=c++17 llamacpp_harness.cpp -I<llama.cpp>/include
//   -I<llama.cpp>/ggml/include -L<build>/bin -lllama -lggml -lggml-base -Wl,-rpath,<build>/bin
//
//   harness MODEL.gguf THREADS time IDS.bin CONTEXTS STEPS PREFILLS   (CONTEXTS, PREFILLS: "128,1024")
//   harness MODEL.gguf THREADS ppl IDS.bin WINDOWS LENGTH
//   harness MODEL.gguf THREADS imatrix IDS.bin WINDOWS LENGTH OUT.imatrix
//   harness MODEL.gguf THREADS quantize OUT.gguf TYPE [IN.imatrix]     (TYPE: Q4_K_M, Q4_0, Q8_0, F32)
//
// The importance matrix is llama-imatrix's: for every matrix multiplication by a block weight
// ("blk.*") with at least 16 activation rows, the mean over rows of each input column's square
// (tools/imatrix/imatrix.cpp's collect_imatrix for dense weights). The output head is left out, as
// llama-imatrix does without --process-output. OUT.imatrix is this harness's own little format:
// per tensor, int32 name length, the name, int32 count, that many float32 means.
// IDS.bin holds int32 token ids (WINDOWS x LENGTH for ppl; at least max(CONTEXTS + STEPS, PREFILLS) for
// time). Prints one JSON object. CPU time is the process's (CLOCK_PROCESS_CPUTIME_ID, all threads).
// Prefill is timed twice: with the last position's logits only (what generation needs, llama.cpp's
// default) and with every position's (what a graph that computes the LM head on all positions pays).
// The context uses llama.cpp's defaults (flash attention "auto", f16 KV cache) but for its sizes.
#include "ggml-backend.h"
#include "ggml.h"
#include "llama.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <map>
#include <string>
#include <vector>

static double now_ms(clockid_t clock) {
    timespec ts;
    clock_gettime(clock, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static std::vector<int> parse_list(const char * text) {
    std::vector<int> out;
    std::string s(text), cur;
    for (char c : s + ",") {
        if (c == ',') {
            if (!cur.empty()) out.push_back(std::atoi(cur.c_str()));
            cur.clear();
        } else {
            cur += c;
        }
    }
    return out;
}

static std::vector<llama_token> read_ids(const char * path) {
    std::vector<llama_token> ids;
    FILE * f = std::fopen(path, "rb");
    if (!f) { std::fprintf(stderr, "cannot open %s\n", path); std::exit(2); }
    int32_t v;
    while (std::fread(&v, sizeof v, 1, f) == 1) ids.push_back(v);
    std::fclose(f);
    return ids;
}

static void quiet(ggml_log_level, const char *, void *) {}

static int decode_or_die(llama_context * ctx, llama_batch batch) {
    int rc = llama_decode(ctx, batch);
    if (rc != 0) { std::fprintf(stderr, "llama_decode failed (%d)\n", rc); std::exit(1); }
    return rc;
}

// a batch of ``n`` tokens at positions ``pos0``.., sequence 0, outputs for all (``all``) or the last
static llama_batch make_batch(const llama_token * tokens, int n, int pos0, bool all) {
    llama_batch b = llama_batch_init(n, 0, 1);
    b.n_tokens = n;
    for (int i = 0; i < n; i++) {
        b.token[i] = tokens[i];
        b.pos[i] = pos0 + i;
        b.n_seq_id[i] = 1;
        b.seq_id[i][0] = 0;
        b.logits[i] = all || i == n - 1;
    }
    return b;
}


struct imatrix_stats {
    std::map<std::string, std::vector<double>> sums;  // per input column: sum of squares
    std::map<std::string, long> rows;
};

// the weight's own name: the graph may call a view of it "name (view)" or wrap it in "#...#"
static std::string weight_name(const char * name) {
    std::string s(name);
    size_t a = s.find('#');
    if (a != std::string::npos) {
        size_t b = s.find('#', a + 1);
        s = s.substr(a + 1, b == std::string::npos ? std::string::npos : b - a - 1);
    }
    return s;
}

static bool collect_imatrix(ggml_tensor * t, bool ask, void * user_data) {
    auto * stats = (imatrix_stats *) user_data;
    const ggml_tensor * src0 = t->src[0];
    const ggml_tensor * src1 = t->src[1];
    if (ask) {
        if (t->op == GGML_OP_MUL_MAT_ID) {
            std::fprintf(stderr, "mixture-of-experts matmuls are not supported by this harness\n");
            std::exit(2);
        }
        if (t->op != GGML_OP_MUL_MAT) return false;
        if (src1->ne[1] < 16 || src1->type != GGML_TYPE_F32) return false;
        return weight_name(src0->name).rfind("blk.", 0) == 0;
    }
    if (!ggml_backend_buffer_is_host(src1->buffer)) {
        std::fprintf(stderr, "activations off the host: this harness runs on the CPU only\n");
        std::exit(2);
    }
    std::string name = weight_name(src0->name);
    const int64_t ne0 = src1->ne[0];
    auto & acc = stats->sums[name];
    if (acc.empty()) acc.assign(ne0, 0.0);
    if ((int64_t) acc.size() != ne0 || src0->ne[2] * src0->ne[3] != 1) {
        std::fprintf(stderr, "unexpected shape for %s\n", name.c_str());
        std::exit(1);
    }
    const char * data = (const char *) src1->data;
    for (int64_t i3 = 0; i3 < src1->ne[3]; i3++) {
        for (int64_t i2 = 0; i2 < src1->ne[2]; i2++) {
            for (int64_t r = 0; r < src1->ne[1]; r++) {
                const float * x = (const float *) (data + r * src1->nb[1] + i2 * src1->nb[2] + i3 * src1->nb[3]);
                for (int64_t j = 0; j < ne0; j++) acc[j] += (double) x[j] * x[j];
            }
        }
    }
    stats->rows[name] += src1->ne[1] * src1->ne[2] * src1->ne[3];
    return true;
}

static int quantize(const char * src, const char * dst, const std::string & type, const char * imatrix_path, int threads) {
    llama_model_quantize_params qp = llama_model_quantize_default_params();
    qp.nthread = threads;
    if (type == "Q4_K_M") qp.ftype = LLAMA_FTYPE_MOSTLY_Q4_K_M;
    else if (type == "Q4_0") qp.ftype = LLAMA_FTYPE_MOSTLY_Q4_0;
    else if (type == "Q8_0") qp.ftype = LLAMA_FTYPE_MOSTLY_Q8_0;
    else if (type == "F32") qp.ftype = LLAMA_FTYPE_ALL_F32;
    else { std::fprintf(stderr, "unknown type %s (Q4_K_M, Q4_0, Q8_0, F32)\n", type.c_str()); return 2; }
    qp.allow_requantize = true;  // a file that is already quantized (the shipped Gemma Q4_K_M) to F32
    std::vector<std::string> names;
    std::vector<std::vector<float>> values;
    std::vector<llama_model_imatrix_data> entries;
    if (imatrix_path) {
        FILE * f = std::fopen(imatrix_path, "rb");
        if (!f) { std::fprintf(stderr, "cannot open %s\n", imatrix_path); return 2; }
        int32_t n;
        while (std::fread(&n, sizeof n, 1, f) == 1) {
            std::string name(n, '\0');
            int32_t count = 0;
            if (std::fread(&name[0], 1, n, f) != (size_t) n || std::fread(&count, sizeof count, 1, f) != 1) break;
            std::vector<float> v(count);
            if (std::fread(v.data(), sizeof(float), count, f) != (size_t) count) break;
            names.push_back(name);
            values.push_back(std::move(v));
        }
        std::fclose(f);
        if (names.empty()) { std::fprintf(stderr, "%s holds no importance matrix\n", imatrix_path); return 2; }
        for (size_t i = 0; i < names.size(); i++) entries.push_back({names[i].c_str(), values[i].data(), values[i].size()});
        entries.push_back({nullptr, nullptr, 0});
        qp.imatrix = entries.data();
    }
    uint32_t rc = llama_model_quantize(src, dst, &qp);
    if (rc != 0) { std::fprintf(stderr, "llama_model_quantize failed (%u)\n", rc); return 1; }
    std::printf("{\"type\": \"%s\", \"imatrix_tensors\": %zu}\n", type.c_str(), names.size());
    return 0;
}

int main(int argc, char ** argv) {
    if (argc < 6) {
        std::fprintf(stderr, "usage: %s MODEL THREADS time IDS CONTEXTS STEPS PREFILLS | ppl IDS WINDOWS LENGTH\n", argv[0]);
        return 2;
    }
    const char * model_path = argv[1];
    int threads = std::atoi(argv[2]);
    std::string mode = argv[3];
    llama_log_set(quiet, nullptr);
    llama_backend_init();
    if (mode == "quantize") return quantize(model_path, argv[4], argv[5], argc > 6 ? argv[6] : nullptr, threads);
    if (mode != "time" && mode != "ppl" && mode != "imatrix") {
        std::fprintf(stderr, "unknown mode %s (time, ppl, imatrix, quantize)\n", mode.c_str());
        return 2;
    }
    if (argc < (mode == "ppl" ? 7 : 8)) { std::fprintf(stderr, "too few arguments for %s\n", mode.c_str()); return 2; }
    std::vector<llama_token> ids = read_ids(argv[4]);
    llama_model_params mp = llama_model_default_params();
    llama_model * model = llama_model_load_from_file(model_path, mp);
    if (!model) { std::fprintf(stderr, "cannot load %s\n", model_path); return 2; }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    int n_vocab = llama_vocab_n_tokens(vocab);

    int longest = 0, steps = 0;
    std::vector<int> contexts, prefills;
    int windows = 0, length = 0;
    if (mode == "time") {
        contexts = parse_list(argv[5]);
        steps = std::atoi(argv[6]);
        prefills = parse_list(argv[7]);
        for (int c : contexts) longest = std::max(longest, c + steps);
        for (int p : prefills) longest = std::max(longest, p);
    } else {
        windows = std::atoi(argv[5]);
        length = std::atoi(argv[6]);
        longest = length;
    }
    if ((int) ids.size() < (mode == "time" ? longest : windows * length)) {
        std::fprintf(stderr, "%s holds %zu ids, too few\n", argv[4], ids.size());
        return 2;
    }
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = longest + 16;
    cp.n_batch = longest + 16;
    cp.n_ubatch = 512;
    cp.n_threads = threads;
    cp.n_threads_batch = threads;
    cp.no_perf = true;
    imatrix_stats stats;
    if (mode == "imatrix") {
        cp.cb_eval = collect_imatrix;
        cp.cb_eval_user_data = &stats;
    }
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) { std::fprintf(stderr, "cannot create a context\n"); return 2; }
    llama_memory_t mem = llama_get_memory(ctx);

    if (mode == "time") {
        // warm-up: one short prefill and step
        llama_memory_clear(mem, true);
        llama_batch w = make_batch(ids.data(), 8, 0, false);
        decode_or_die(ctx, w);
        llama_batch_free(w);
        std::printf("{\"llama_version\": \"%s\", \"system_info\": \"%s\", \"prefill\": [", llama_version(),
                    llama_print_system_info());
        for (size_t k = 0; k < prefills.size(); k++) {
            double cpu[2], wall[2];
            for (int all = 0; all < 2; all++) {
                llama_memory_clear(mem, true);
                llama_batch b = make_batch(ids.data(), prefills[k], 0, all == 1);
                double c0 = now_ms(CLOCK_PROCESS_CPUTIME_ID), t0 = now_ms(CLOCK_MONOTONIC);
                decode_or_die(ctx, b);
                cpu[all] = now_ms(CLOCK_PROCESS_CPUTIME_ID) - c0;
                wall[all] = now_ms(CLOCK_MONOTONIC) - t0;
                llama_batch_free(b);
            }
            std::printf("%s{\"tokens\": %d, \"cpu_ms\": %.4f, \"wall_ms\": %.4f, \"all_logits_cpu_ms\": %.4f, "
                        "\"all_logits_wall_ms\": %.4f}", k ? ", " : "", prefills[k], cpu[0], wall[0], cpu[1], wall[1]);
        }
        std::printf("], \"decode\": [");
        for (size_t k = 0; k < contexts.size(); k++) {
            int c = contexts[k];
            llama_memory_clear(mem, true);
            llama_batch b = make_batch(ids.data(), c, 0, false);
            decode_or_die(ctx, b);
            llama_batch_free(b);
            std::printf("%s{\"context\": %d, \"cpu_ms\": [", k ? ", " : "", c);
            std::vector<double> walls;
            for (int i = 0; i < steps; i++) {
                llama_batch s = make_batch(ids.data() + c + i, 1, c + i, false);
                double c0 = now_ms(CLOCK_PROCESS_CPUTIME_ID), t0 = now_ms(CLOCK_MONOTONIC);
                decode_or_die(ctx, s);
                float * logits = llama_get_logits_ith(ctx, -1);
                double cpu = now_ms(CLOCK_PROCESS_CPUTIME_ID) - c0;
                walls.push_back(now_ms(CLOCK_MONOTONIC) - t0);
                llama_batch_free(s);
                if (!logits || !std::isfinite(logits[0])) { std::fprintf(stderr, "non-finite logits\n"); return 1; }
                std::printf("%s%.4f", i ? ", " : "", cpu);
            }
            std::printf("], \"wall_ms\": [");
            for (size_t i = 0; i < walls.size(); i++) std::printf("%s%.4f", i ? ", " : "", walls[i]);
            std::printf("]}");
        }
        std::printf("]}\n");
    } else if (mode == "imatrix") {
        for (int w = 0; w < windows; w++) {
            llama_memory_clear(mem, true);
            // all outputs, as llama-imatrix asks for: the last block's FFN then runs on every position
            llama_batch b = make_batch(ids.data() + (size_t) w * length, length, 0, true);
            decode_or_die(ctx, b);
            llama_batch_free(b);
        }
        FILE * f = std::fopen(argv[7], "wb");
        if (!f) { std::fprintf(stderr, "cannot write %s\n", argv[7]); return 2; }
        for (const auto & kv : stats.sums) {
            int32_t n = (int32_t) kv.first.size(), count = (int32_t) kv.second.size();
            double rows = (double) stats.rows[kv.first];
            std::vector<float> mean(count);
            for (int32_t j = 0; j < count; j++) mean[j] = (float) (kv.second[j] / rows);
            std::fwrite(&n, sizeof n, 1, f);
            std::fwrite(kv.first.data(), 1, n, f);
            std::fwrite(&count, sizeof count, 1, f);
            std::fwrite(mean.data(), sizeof(float), count, f);
        }
        std::fclose(f);
        long min_rows = stats.rows.empty() ? 0 : stats.rows.begin()->second;
        for (const auto & kv : stats.rows) min_rows = std::min(min_rows, kv.second);
        std::printf("{\"tensors\": %zu, \"min_rows\": %ld}\n", stats.sums.size(), min_rows);
    } else {
        double nll = 0.0;
        long count = 0;
        for (int w = 0; w < windows; w++) {
            llama_memory_clear(mem, true);
            const llama_token * row = ids.data() + (size_t) w * length;
            llama_batch b = make_batch(row, length, 0, true);
            decode_or_die(ctx, b);
            for (int i = 0; i + 1 < length; i++) {
                const float * lg = llama_get_logits_ith(ctx, i);
                double mx = lg[0];
                for (int v = 1; v < n_vocab; v++) mx = std::max(mx, (double) lg[v]);
                double sum = 0.0;
                for (int v = 0; v < n_vocab; v++) sum += std::exp((double) lg[v] - mx);
                nll += std::log(sum) + mx - (double) lg[row[i + 1]];
                count++;
            }
            llama_batch_free(b);
        }
        std::printf("{\"nll\": %.10f, \"tokens\": %ld}\n", nll, count);
    }
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}

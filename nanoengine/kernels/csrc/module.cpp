// nanoengine's CPU kernels (chapter 06): the Python module. One extension built from every csrc/*.cpp by
// nanoengine/kernels/cpu.py; this file only binds what the family files define (declared in kernels.h).
// Every kernel lets go of the GIL while it computes (they touch no Python object), so a decode step on the
// engine's forward thread runs beside the host's Python (overlap scheduling, chapter 06).
#include <torch/extension.h>

#include "kernels.h"
#include "simd.h"

#include <map>
#include <string>
#include <vector>

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace nanoengine;
  const auto nogil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("paged_decode", &paged_decode, "paged decode attention on CPU (reads K/V in place; a bf16 cache under float32 q)",
        pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("block_tables"),
        pybind11::arg("context_lens"), pybind11::arg("scale"), pybind11::arg("path") = "auto", nogil);
  m.def("rms_norm", &rms_norm, "(residual +) RMSNorm: returns [normed] or [normed, residual sum]", nogil);
  m.def("rotary", &rotary, "rotary embedding of [T, heads, D] rows (a copy)", nogil);
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up", nogil);
  m.def("bf16_pack", &bf16_pack, "lay a weight out for bf16_linear (blocks of 8 rows [blocks, K, 8], or of 16 rows in "
        "column pairs [blocks, K2, 16, 2] for the AVX-512 paths)", pybind11::arg("weight"), pybind11::arg("path") = "auto",
        nogil);
  m.def("bf16_linear", &bf16_linear, "x @ W^T (+ bias) with a bf16_pack-ed weight, float32 sums (small batches)",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("bias"), pybind11::arg("N"),
        pybind11::arg("path") = "auto", nogil);
  m.def("bf16_best_path", &bf16_best_path, "the bf16_linear path 'auto' runs here");
  m.def("int8_pack", &int8_pack, "lay an int8 weight and its scales out for int8_linear (blocks of 16 rows)", nogil);
  m.def("int8_linear", &int8_linear, "x @ (q * s)^T (+ bias) with int8_pack-ed int8 weights, float32 sums (small batches)",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("scales"), pybind11::arg("bias"), pybind11::arg("N"),
        pybind11::arg("group_size"), pybind11::arg("path") = "auto", nogil);
  m.def("w8a8_pack", &w8a8_pack, "lay an int8 weight and its scales out for int8_linear with int8 activations (W8A8: "
        "blocks of 16 rows, 4 columns per lane)", pybind11::arg("q"), pybind11::arg("scales"), pybind11::arg("group_size"),
        nogil);
  m.def("simd_paths", [] {
    std::vector<std::string> have;
#ifdef NANOENGINE_AVX2
    have.push_back("avx2");
#endif
#ifdef NANOENGINE_AVXVNNI
    have.push_back("avxvnni");
#endif
#ifdef NANOENGINE_AVX512
    have.push_back("avx512");
#endif
#ifdef NANOENGINE_AVX512BF16
    have.push_back("avx512bf16");
#endif
#ifdef NANOENGINE_AVX512VNNI
    have.push_back("avx512vnni");
#endif
    return have;
  }, "the instruction sets this build's kernels use (beside plain loops)");
  m.def("auto_paths", [] {
    std::map<std::string, std::string> paths;  // what each kernel's path="auto" runs in this build
    paths["bf16_linear"] = bf16_best_path();
#if defined(__AVX512F__) && defined(NANOENGINE_AVX2)
    paths["int8_linear"] = "avx512";
#elif defined(NANOENGINE_AVX2)
    paths["int8_linear"] = "avx2";
#else
    paths["int8_linear"] = "plain";
#endif
#if defined(NANOENGINE_AVX512VNNI)
    paths["w8a8_linear"] = "avx512vnni";
#elif defined(NANOENGINE_AVXVNNI)
    paths["w8a8_linear"] = "avxvnni";
#elif defined(NANOENGINE_AVX2)
    paths["w8a8_linear"] = "avx2";
#else
    paths["w8a8_linear"] = "plain";
#endif
#ifdef NANOENGINE_AVX2
    paths["paged_decode"] = "avx2";
#else
    paths["paged_decode"] = "plain";
#endif
    return paths;
  }, "what each kernel's path='auto' runs in this build");
  pybind11::class_<Linear>(m, "Linear")
      .def(pybind11::init([](c10::optional<at::Tensor> packed, at::Tensor weight, c10::optional<at::Tensor> bias,
                             int64_t out_features, c10::optional<at::Tensor> int8,
                             c10::optional<at::Tensor> int8_scales, int64_t group_size,
                             c10::optional<at::Tensor> onednn, int64_t onednn_min_rows) {
             return Linear{packed, weight, bias, out_features, int8, int8_scales, group_size, onednn, onednn_min_rows};
           }),
           pybind11::arg("packed"), pybind11::arg("weight"), pybind11::arg("bias"), pybind11::arg("out_features"),
           pybind11::arg("int8") = c10::nullopt, pybind11::arg("int8_scales") = c10::nullopt,
           pybind11::arg("group_size") = 0, pybind11::arg("onednn") = c10::nullopt,
           pybind11::arg("onednn_min_rows") = 0)
      .def("__call__", [](const Linear& linear, const at::Tensor& x) { return linear(x); },
           "x @ W^T (+ bias) as decode_layers runs this projection", nogil);
  m.def("onednn_bf16_linear", &onednn_bf16_linear, "float32 x rounded to bf16 @ a oneDNN-packed bf16 weight "
        "(torch.ops.mkldnn._reorder_linear_weight), cast back to float32, + bias", pybind11::arg("x"),
        pybind11::arg("onednn"), pybind11::arg("bias") = c10::nullopt, nogil);
  pybind11::class_<DecodeLayer>(m, "DecodeLayer")
      .def(pybind11::init<at::Tensor, at::Tensor, c10::optional<at::Tensor>, c10::optional<at::Tensor>, Linear,
                          Linear, Linear, Linear, at::Tensor, at::Tensor>(),
           pybind11::arg("input_norm"), pybind11::arg("post_norm"), pybind11::arg("q_norm"), pybind11::arg("k_norm"),
           pybind11::arg("qkv"), pybind11::arg("o"), pybind11::arg("gate_up"), pybind11::arg("down"),
           pybind11::arg("k_cache"), pybind11::arg("v_cache"));
  m.def("decode_layers", &decode_layers, "a decode step's decoder layers in one call (the same kernels, in order)", nogil);
}

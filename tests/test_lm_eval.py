"""lm-evaluation-harness's `local-completions` against a test server equals its `hf` model (transformers on
the same weights) on two tiny local tasks (tests/data/lm_eval/): a multiple-choice task (each choice's
loglikelihood over the server: echo + logprobs with max_tokens 1) and a generate_until task (greedy, stop
strings). smollm2-135m, a real model, so the accuracies are neither 0 nor 1.

Tie-breaks: equal accuracies could hide a different choice picked between two near-equal loglikelihoods, so
every choice's loglikelihood is compared (within TOL) and the task's docs are checked to have no two choices
within 10 * TOL of the best one (a flip would need an error ten times the one allowed)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("tenacity", reason="lm-eval's API models need lm-eval[api]: run `make setup`")

TASKS = Path(__file__).parent / "data" / "lm_eval"
MODEL = "smollm2-135m"
TOL = 1e-3  # nats: float32 on both sides, different attention code (measured: 1.6e-5 at most)
BATCH = 8


def _evaluate(model: str, model_args: dict):
    import lm_eval
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=str(TASKS))
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["nano_mc", "nano_gen"],
                                   device="cpu", batch_size=BATCH, task_manager=tasks, log_samples=True,
                                   random_seed=0, numpy_random_seed=0, torch_random_seed=0)


def _samples(result: dict, task: str) -> list[dict]:
    return sorted(result["samples"][task], key=lambda s: s["doc_id"])


@pytest.mark.slow
@pytest.mark.xdist_group("lm-eval")
def test_local_completions_against_the_server_equals_hf(smollm2_path, monkeypatch):
    from nanoengine.serve.server import Server

    monkeypatch.chdir(TASKS)  # the tasks' data_files are relative
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    hf = _evaluate("hf", {"pretrained": str(smollm2_path), "dtype": "float32"})
    engine = {"dtype": "float32", "max_model_len": 512, "num_kvcache_blocks": 256}
    with Server(MODEL, port=0, log_level="warning", engine_options=engine) as server:
        api = _evaluate("local-completions", {"base_url": f"{server.url}/completions", "model": MODEL,
                                              "tokenizer": str(smollm2_path),
                                              "tokenizer_backend": "huggingface", "max_length": 512})

    # multiple choice: every choice's loglikelihood, then the accuracy
    mc_hf, mc_api = _samples(hf, "nano_mc"), _samples(api, "nano_mc")
    assert len(mc_hf) == len(mc_api) == 12
    for a, b in zip(mc_hf, mc_api, strict=True):
        lls_hf = [r[0][0] for r in a["resps"]]
        lls_api = [r[0][0] for r in b["resps"]]
        assert lls_api == pytest.approx(lls_hf, abs=TOL), a["doc"]
        best, second = sorted(lls_hf, reverse=True)[:2]
        assert best - second > 10 * TOL, f"near tie in {a['doc']}: pick a clearer doc"
    acc_hf, acc_api = hf["results"]["nano_mc"]["acc,none"], api["results"]["nano_mc"]["acc,none"]
    assert acc_api == acc_hf and 0 < acc_hf < 1

    # generate_until: the same greedy text per doc, then the same exact_match
    gen_hf, gen_api = _samples(hf, "nano_gen"), _samples(api, "nano_gen")
    assert [s["filtered_resps"] for s in gen_api] == [s["filtered_resps"] for s in gen_hf]
    em_hf, em_api = (r["results"]["nano_gen"]["exact_match,strip"] for r in (hf, api))
    assert em_api == em_hf and 0 < em_hf < 1

"""Hugging Face models just work: ModelOutput through every precision, dict batches,
the model's own loss, powersgd, checkpoint and resume, and examples/train_hf.py.

Needs transformers (the ``hf`` extra): without it these tests skip, except in CI
(CI=true), where they fail.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import need_module
from tests.harness import run_ranks
from tests.train.hf_workers import PER_RANK, SEQ, hf_batch, tiny_gpt2, train_hf_everything

REPO = Path(__file__).resolve().parents[2]


def require_transformers() -> None:
    need_module("transformers", "pip install 'slipstream[hf]'")


class Counts:
    samples = tokens = 0

    def add_samples(self, n: int) -> None:
        self.samples += n

    def add_tokens(self, n: int) -> None:
        self.tokens += n


def test_count_inputs_understands_a_dict_batch():
    from slipstream.train.microsteps import count_inputs

    batch = hf_batch(0, 0)
    # labels first: the count must come from input_ids, not from the first keyword
    for args, kwargs in [((), {"labels": batch["labels"][:, :3], **batch}), ((batch,), {}),
                         ((batch["input_ids"],), {"attention_mask": batch["attention_mask"]}),
                         ((None,), {"input_ids": batch["input_ids"]})]:
        counts = Counts()
        count_inputs(counts, args, kwargs)
        assert (counts.samples, counts.tokens) == (PER_RANK, PER_RANK * SEQ), (args, list(kwargs))
    counts = Counts()
    count_inputs(counts, (), {"pixel_values": torch.zeros(3, 2, 4, 4)})
    assert (counts.samples, counts.tokens) == (3, 0)


def test_pipeline_parallelism_refuses_a_dict_batch_and_a_model_loss():
    from types import SimpleNamespace

    from slipstream.config import TrainConfig
    from slipstream.errors import ConfigError
    from slipstream.train.facade import Accelerated
    from slipstream.train.microsteps import MicroSteps

    # Only the layout's pipeline is read before the refusal: stand-ins for the rest.
    layout = SimpleNamespace(pipeline=SimpleNamespace(run=lambda *a: pytest.fail("the schedule ran")))
    run = Accelerated(layout, None, TrainConfig.from_env(pp=2), SimpleNamespace(device=torch.device("cpu")),
                      None, MicroSteps(1))
    batch = hf_batch(0, 0)
    refused = r"with pp\(2\) give train_step\(inputs, target, loss_fn\) with a tensor of inputs, got {}"
    with pytest.raises(ConfigError, match=refused.format("dict inputs and no loss_fn")):
        run.train_step(batch)
    with pytest.raises(ConfigError, match=refused.format("Tensor inputs and no loss_fn")):
        run.train_step(batch["input_ids"])


def test_a_real_model_output_keeps_its_type_under_autocast():
    require_transformers()
    from slipstream.train.precision import autocast, outputs_to_fp32

    model = tiny_gpt2()
    with autocast("bf16", torch.device("cpu")):
        raw = model(**hf_batch(0, 0))
    assert raw.logits.dtype == torch.bfloat16
    out = outputs_to_fp32(raw)
    assert type(out) is type(raw) and list(out.keys()) == list(raw.keys())
    assert out.loss is raw.loss and out[0] is out.loss and out["loss"] is out.loss
    assert out.logits.dtype == torch.float32 and out[1] is out.logits
    out.loss.backward()  # the graph goes through the cast


def test_train_step_forms_and_what_they_refuse():
    require_transformers()
    import slipstream
    from slipstream.errors import ConfigError

    slipstream.init()
    try:
        model = tiny_gpt2()
        run = slipstream.accelerate(model, torch.optim.SGD(model.parameters(), lr=0.1), progress=False,
                                    run_dir=None)
        batch = hf_batch(0, 0)
        with pytest.raises(ConfigError, match="got a target but no loss_fn"):
            run.train_step(batch, batch["labels"])
        unlabeled = {k: v for k, v in batch.items() if k != "labels"}
        with pytest.raises(ConfigError, match="no loss among them; put the labels in the batch"):
            run.train_step(unlabeled)
        with pytest.raises(ConfigError, match=r"got a CausalLMOutputWithCrossAttentions .*\(pass outputs.loss\)"):
            run.backward(run.model(**batch))
        # The (inputs, target, loss_fn) form is unchanged: model(inputs), then the function's loss.
        def shifted_loss(out, labels):
            return torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())

        ids = batch["input_ids"]
        with torch.no_grad():
            expected = float(model(input_ids=ids, labels=batch["labels"]).loss)
        loss = run.train_step(ids, batch["labels"], shifted_loss)
        assert float(loss) == pytest.approx(expected, rel=1e-5) and run.step_count == 1
        assert float(run.train_step(batch)) < expected and run.step_count == 2  # SGD stepped: the loss fell
        run.finish()
    finally:
        slipstream.shutdown()


@pytest.mark.distributed
def test_gpt2_trains_at_two_ranks_in_bf16_and_powersgd_and_resumes_bitwise(tmp_path):
    require_transformers()
    results = run_ranks(train_hf_everything, 2, str(tmp_path), timeout_s=240)
    for rank, r in enumerate(results):
        bf16 = r["bf16_losses"]
        assert bf16[-1] < 0.75 * bf16[0], f"rank {rank}: bf16 loss {bf16}"
        # log_every_steps=1: totals of the job (both ranks), from input_ids of each dict batch
        assert (r["samples"], r["tokens"]) == (10 * PER_RANK * 2, 10 * PER_RANK * SEQ * 2)
        whole = r["whole_losses"]
        assert whole[-1] < 0.85 * whole[0], f"rank {rank}: powersgd loss {whole}"
        assert (r["resumed_from"], r["resumed_micro"]) == (4, 4)
        # The resumed run continues exactly: same losses, same weights, bit for bit.
        assert r["first_losses"] + r["second_losses"] == whole
        for name, p in r["whole"].items():
            assert torch.equal(r["resumed"][name], p), f"rank {rank}: {name} differs after resume"
    assert all(torch.equal(results[0]["whole"][n], results[1]["whole"][n]) for n in results[0]["whole"])


def test_the_example_trains_alone(tmp_path):
    require_transformers()
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "examples/train_hf.py", "--steps", "4", "--batch-size", "2", "--layers", "1",
         "--hidden", "32", "--context", "16", "--corpus-mb", "0.1", "--out", str(out), "--seed", "3"],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "done: 4 steps" in proc.stdout
    state = torch.load(out / "model.pt")
    assert state and all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())

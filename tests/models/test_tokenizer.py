import json
import re

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers, processors, trainers

from mk.models import load_tokenizer

SENTENCES = ["the cat sat on the mat", "a dog ate the cat food", "the mat is red"]


def _build(folder, bos_in_post_processor: bool, tokenizer_config: dict | None, config: dict | None = None):
    tok = HFTokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>"]))
    if bos_in_post_processor:   # as Llama 3's tokenizer.json does
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(folder / "tokenizer.json"))
    if tokenizer_config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return tok


@pytest.mark.parametrize("bos_in_post_processor", [False, True], ids=["plain", "template"])
def test_encode_adds_bos_once(tmp_path, bos_in_post_processor):
    _build(tmp_path, bos_in_post_processor, {"bos_token": {"content": "<s>"}, "eos_token": "</s>"})
    tok = load_tokenizer(tmp_path)
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2,)
    ids = tok.encode("the cat sat on the mat")
    assert ids[0] == 1 and ids.count(1) == 1 and len(ids) == 7
    assert tok.decode(ids) == "the cat sat on the mat"
    assert "<s>" in tok.decode(ids, skip_special_tokens=False)
    if not bos_in_post_processor:   # the tokenizer's own template is not undone
        assert tok.encode("the cat", add_bos=False) == ids[1:3]


def test_add_bos_false_and_config_fallback(tmp_path):
    _build(tmp_path, False, {"add_bos_token": False},
           config={"bos_token_id": 1, "eos_token_id": [2, 0]})
    tok = load_tokenizer(tmp_path)
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2, 0)
    assert tok.encode("red mat")[0] != 1
    assert tok.encode("red mat", add_bos=True)[0] == 1
    assert tok.vocab_size == len(set(" ".join(SENTENCES).split())) + 3


def test_no_tokenizer(tmp_path):
    assert load_tokenizer(tmp_path) is None


def test_broken_tokenizer_file(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_tokenizer(tmp_path)


# ------------------------------------------------------------------ chat templates

#: Llama-3-8B-Instruct's template, as the checkpoint ships it.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + "
    "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")

#: A template written over several lines, as Llama 3.1's is: block tags on lines of their own
#: (trim_blocks / lstrip_blocks decide the whitespace), a system message taken out of the
#: loop, raise_exception on a bad role, strftime_now, tojson and the pad token.
SYSTEM_TEMPLATE = """{{ bos_token }}
{% if messages[0]['role'] == 'system' %}
    {% set system = messages[0]['content'] %}
    {% set messages = messages[1:] %}
{% else %}
    {% set system = 'the default system' %}
{% endif %}
<|start_header_id|>system<|end_header_id|>

{{ system }} {{ strftime_now('%Y') | length }} {{ {'pad': pad_token} | tojson }}<|eot_id|>
{% for message in messages %}
    {% if message['role'] not in ['user', 'assistant'] %}
        {{ raise_exception('roles must be user or assistant, got ' + message['role']) }}
    {% endif %}
<|start_header_id|>{{ message['role'] }}<|end_header_id|>

{{ message['content'] }}<|eot_id|>
{% endfor %}
{% if add_generation_prompt %}
<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

CHAT_SPECIALS = ["<unk>", "<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>", "<pad>"]
CHAT_WORDS = ["user assistant system the default cat sat on mat who are you 4 {\" \": \" \"} pad"]


def _build_chat(folder, template_in: str, template: str):
    """A Llama-3-like tokenizer (BOS added by its post-processor) with ``template`` in
    tokenizer_config.json ("config"), as a named list there ("list") or in chat_template.jinja ("file")."""
    tok = HFTokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(CHAT_WORDS, trainers.WordLevelTrainer(special_tokens=CHAT_SPECIALS))
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                       special_tokens=[("<|begin_of_text|>", 1)])
    tok.save(str(folder / "tokenizer.json"))
    cfg = {"bos_token": "<|begin_of_text|>", "eos_token": {"content": "<|eot_id|>"}, "pad_token": "<pad>"}
    if template_in == "config":
        cfg["chat_template"] = template
    elif template_in == "list":
        cfg["chat_template"] = [{"name": "tool_use", "template": "nope"}, {"name": "default", "template": template}]
    else:
        (folder / "chat_template.jinja").write_text(template)
        cfg["chat_template"] = "this one is not used: the .jinja file wins"
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))


CONVERSATIONS = {
    "user": [{"role": "user", "content": " who are you "}],
    "system": [{"role": "system", "content": "the cat sat"}, {"role": "user", "content": "who are you"},
               {"role": "assistant", "content": "the cat", "tool_calls": None},
               {"role": "user", "content": "on the mat"}],
}


@pytest.mark.parametrize("template_in", ["config", "list", "file"])
@pytest.mark.parametrize("template", ["llama3", "system"])
@pytest.mark.parametrize("conversation", ["user", "system"])
def test_chat_template_matches_transformers(tmp_path, template_in, template, conversation):
    from transformers import PreTrainedTokenizerFast

    source = LLAMA3_TEMPLATE if template == "llama3" else SYSTEM_TEMPLATE
    _build_chat(tmp_path, template_in, source)
    tok = load_tokenizer(tmp_path)
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"), bos_token="<|begin_of_text|>",
                                 eos_token="<|eot_id|>", pad_token="<pad>")
    hf.chat_template = source
    messages = CONVERSATIONS[conversation]
    for gen in (True, False):
        text = tok.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
        assert text == hf.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
        ids = tok.apply_chat_template(messages, add_generation_prompt=gen)
        assert ids == hf.apply_chat_template(messages, add_generation_prompt=gen, return_dict=False)
        assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1   # the template's BOS only
        assert "<unk>" not in tok.decode(ids, skip_special_tokens=False)
        assert text.endswith("assistant<|end_header_id|>\n\n") == gen
    if template == "system":
        assert ("the default system" in text) == (conversation == "user")
        assert '{"pad": "<pad>"}' in text   # tojson as transformers writes it (no HTML escapes)


def test_chat_template_errors(tmp_path):
    _build_chat(tmp_path, "config", SYSTEM_TEMPLATE)
    tok = load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="roles must be user or assistant, got tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match="non-empty list of dicts"):
        tok.apply_chat_template("who are you")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|begin_of_text|>"}))
    tok = load_tokenizer(tmp_path)
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    tok.chat_template = "{% for m in messages %}"
    with pytest.raises(ValueError, match="not valid Jinja"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_template_is_sandboxed(tmp_path):
    _build_chat(tmp_path, "config", "{{ messages.__class__.__mro__ }}")
    with pytest.raises(ValueError, match="unsafe"):
        load_tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}])


# ------------------------------------------------------------------ issue 52: bad files and templates


@pytest.mark.parametrize("write, fragment", [
    (lambda f: (f / "tokenizer_config.json").write_text("[1, 2, 3]"),
     "tokenizer_config.json: expected a JSON object, got list"),
    (lambda f: (f / "tokenizer_config.json").write_bytes(b'{"bos_token": "\xff"}'),
     "tokenizer_config.json: not UTF-8 text"),
    (lambda f: (f / "tokenizer_config.json").write_text('{"eos_token": 5}'),
     'tokenizer_config.json: eos_token must be a string or {"content": string}, got 5'),
    (lambda f: (f / "tokenizer_config.json").write_text('{"bos_token": {"content": ["<s>"]}}'),
     "tokenizer_config.json: bos_token must be a string"),
    (lambda f: (f / "tokenizer_config.json").write_text('{"chat_template": 42}'),
     "tokenizer_config.json: chat_template must be a string or a list of named templates, got 42"),
    (lambda f: (f / "tokenizer_config.json").write_text('{"chat_template": [{"name": "default"}]}'),
     "tokenizer_config.json: chat_template must be a string or a list of"),
    (lambda f: (f / "tokenizer_config.json").write_text('{"add_bos_token": "false"}'),
     "tokenizer_config.json: add_bos_token must be true or false (a JSON boolean), got 'false'"),
    (lambda f: (f / "chat_template.jinja").write_bytes(b"{{ bos_token }}\xff"), "chat_template.jinja: not UTF-8 text"),
    (lambda f: (f / "chat_template.jinja").mkdir(), "chat_template.jinja: is a folder, not a regular file"),
    (lambda f: (f / "config.json").write_text("[" * 100000), "config.json: invalid JSON"),
])
def test_unreadable_tokenizer_files_name_the_file_and_field(tmp_path, write, fragment):
    _build(tmp_path, False, None)
    write(tmp_path)
    with pytest.raises(ValueError, match="^" + re.escape(str(tmp_path) + "/") + ".*" + re.escape(fragment)):
        load_tokenizer(tmp_path)


def test_a_tokenizer_json_that_is_a_folder_is_no_missing_tokenizer(tmp_path):
    (tmp_path / "tokenizer.json").mkdir()
    with pytest.raises(ValueError, match="tokenizer.json: is a folder, not a regular file"):
        load_tokenizer(tmp_path)


def test_encode_and_decode_refuse_what_is_no_text_or_id(tmp_path):
    _build(tmp_path, False, {"bos_token": "<s>"})
    tok = load_tokenizer(tmp_path)
    for bad in (None, 5, b"the cat"):
        with pytest.raises(TypeError, match=f"text must be a str, got {type(bad).__name__}"):
            tok.encode(bad)
    with pytest.raises(TypeError, match="add_bos must be a bool or None"):
        tok.encode("the cat", add_bos="no")
    for ids, k, i in (([-1], 0, -1), ([1, 2**40], 1, 2**40), ([3, 4, 2**32], 2, 2**32)):
        with pytest.raises(ValueError, match=rf"ids\[{k}\] is {i}, not a token id"):
            tok.decode(ids)
    with pytest.raises(TypeError, match="ids must be a sequence of ints, got str"):
        tok.decode("12")
    with pytest.raises(TypeError, match=r"ids must be ints, got 1.5 \(float\) at ids\[1\]"):
        tok.decode([1, 1.5])
    assert tok.decode([4, 2**32 - 1]) == tok.decode([4])   # beyond the vocabulary (a padded one): nothing


RAISING_TEMPLATES = [
    ("{{ 1 // 0 }}", "ZeroDivisionError: integer division or modulo by zero"),
    ("{% for i in range(10**9) %}{% endfor %}", "its range() calls ask for more than 100000 items in all"),
    ("{% for i in range(1000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}",
     "its range() calls ask for more than 100000 items"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "it recurses without end"),
    ("{{ messages[0]['content'] + 1 }}", "TypeError: can only concatenate str"),
    ("{{ 'a' * 10**9 }}", "it repeats a str of 1 items 1000000000 times (at most 16777216 items)"),
    ("{{ [messages] * 10**9 }}", "it repeats a list"),
    ("{% set s = namespace(x='ab') %}{% for i in range(60) %}{% set s.x = s.x ~ s.x %}{% endfor %}",
     "it makes a str of"),
    ("{% set s = namespace(x='ab') %}{% for i in range(60) %}{% set s.x = s.x + s.x %}{% endfor %}",
     "it makes a str of"),
    ("{{ 2 ** (10**9) }}", "it raises 2 to the power 1000000000"),
    ("{{ 'a' | center(10**9) }}", "it passes a width or count of 1000000000"),
    ("{{ 'a'.ljust(10**9) }}", "it passes a width or count of 1000000000"),
    ("{{ '%*s' % (10**9, 'a') }}", "it passes a width or count of 1000000000"),
    ("{{ '%1000000000s' % 'a' }}", "it formats with a width of 1000000000"),
    ("{{ '{:>1000000000}'.format(1) }}", "it formats with a width of 1000000000"),
    ("{{ ([1] * 1000000) | join('x' * 100) }}", "it joins"),
    ("{% for i in range(100000) %}{{ 'abcdefghijklmnopqrstuvwxyz' * 10 }}{% endfor %}",
     "the rendered text passes 16777216 characters"),
]


@pytest.mark.parametrize("template, fragment", RAISING_TEMPLATES, ids=[t for t, _ in RAISING_TEMPLATES])
def test_a_failing_or_runaway_chat_template_is_one_value_error(tmp_path, template, fragment):
    _build_chat(tmp_path, "file", template)
    tok = load_tokenizer(tmp_path)
    with pytest.raises(ValueError) as e:
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert str(e.value).startswith(f"chat template of {tmp_path / 'chat_template.jinja'}: ") and \
        fragment in str(e.value), str(e.value)


def test_bounded_chat_templates_still_do_what_templates_do(tmp_path):
    template = ("{{ '%d-%s' % (1700000000, 'x') }} {{ 1700000000 | string }} {{ 'ab' * 3 }} {{ 'a' | center(5) }}|"
                "{{ '{:>4}'.format(7) }} {{ range(3) | list | join(',') }} {{ 2 ** 10 }} {{ messages[0]['content'] }}")
    _build_chat(tmp_path, "config", template)
    text = load_tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "%99999999999d"}],
                                                        tokenize=False)
    assert text == "1700000000-x 1700000000 ababab   a  |   7 0,1,2 1024 %99999999999d"

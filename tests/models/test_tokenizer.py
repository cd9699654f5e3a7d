import json

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

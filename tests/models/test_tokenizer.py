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

from trl_fp8.tokenization import CHARACTERS, SPECIAL_TOKENS, build_char_tokenizer, char_vocab


def test_vocab_layout():
    vocab = char_vocab()
    assert [vocab[t] for t in SPECIAL_TOKENS] == [0, 1, 2]
    assert len(vocab) == len(SPECIAL_TOKENS) + len(CHARACTERS)


def test_round_trip_one_token_per_character(tmp_path):
    from transformers import AutoTokenizer

    tok = build_char_tokenizer()
    text = "37+45=\\boxed{82}\nok"
    ids = tok(text)["input_ids"]
    assert len(ids) == len(text)
    assert tok.decode(ids) == text
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded(text)["input_ids"] == ids
    assert (loaded.pad_token_id, loaded.eos_token_id) == (0, 1)
    assert loaded.decode(ids + [loaded.eos_token_id], skip_special_tokens=True) == text


def test_unknown_characters_map_to_unk():
    tok = build_char_tokenizer()
    assert tok("é")["input_ids"] == [tok.unk_token_id]


def test_chat_template_renders():
    tok = build_char_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": "1+1="}], tokenize=False, add_generation_prompt=True)
    assert text == "user: 1+1=\nassistant: "

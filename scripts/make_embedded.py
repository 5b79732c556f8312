"""Regenerate memrecipe's embedded default: a small chat dataset, a BPE tokenizer trained on it,
and the tiny Llama config the loop builds its model from (random weights, fixed seed).

    python scripts/make_embedded.py      # writes cli/memrecipe/data/
"""

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, PreTrainedTokenizerFast

OUT = Path(__file__).resolve().parent.parent / "cli" / "memrecipe" / "data"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]

CAPITALS = {"France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Japan": "Tokyo",
            "Canada": "Ottawa", "Egypt": "Cairo", "Kenya": "Nairobi", "Peru": "Lima", "Chile": "Santiago",
            "Norway": "Oslo", "Sweden": "Stockholm", "Poland": "Warsaw", "Greece": "Athens", "Cuba": "Havana",
            "India": "New Delhi", "China": "Beijing", "Brazil": "Brasilia", "Mexico": "Mexico City",
            "Ireland": "Dublin", "Austria": "Vienna", "Portugal": "Lisbon", "Finland": "Helsinki",
            "Denmark": "Copenhagen", "Turkey": "Ankara", "Iran": "Tehran", "Thailand": "Bangkok"}
COLORS = {"the sky": "blue", "grass": "green", "snow": "white", "coal": "black", "a banana": "yellow",
          "a tomato": "red", "an orange": "orange", "a plum": "purple", "chocolate": "brown", "the sun": "yellow",
          "a lemon": "yellow", "a cherry": "red", "the sea": "blue", "a leaf": "green", "milk": "white"}
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
WORDS = ["apple", "river", "stone", "cloud", "light", "green", "table", "music", "happy", "quiet", "ocean",
         "paper", "smile", "bread", "chair", "dream", "earth", "flame", "grape", "honey"]


def examples(rng: random.Random) -> list[dict]:
    out = []
    for country, capital in CAPITALS.items():
        out.append(("What is the capital of %s?" % country, "The capital of %s is %s." % (country, capital)))
    for thing, color in COLORS.items():
        out.append(("What color is %s?" % thing, "%s is %s." % (thing[0].upper() + thing[1:], color)))
    for i, day in enumerate(DAYS):
        out.append(("What day comes after %s?" % day, "After %s comes %s." % (day, DAYS[(i + 1) % 7])))
    for a in range(13):
        for b in range(13):
            out.append(("What is %d plus %d?" % (a, b), "%d plus %d is %d." % (a, b, a + b)))
    for _ in range(120):
        words = " ".join(rng.sample(WORDS, 3))
        out.append(("Repeat after me: %s" % words, words))
    rng.shuffle(out)
    rows = []
    for question, answer in out:
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        if rng.random() < 0.3:
            messages.insert(0, {"role": "system", "content": "You are a helpful assistant. Answer in one sentence."})
        rows.append({"messages": messages})
    return rows


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    rows = examples(random.Random(0))
    with open(OUT / "chat.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    texts = [f"{m['role']}\n{m['content']}" for row in rows for m in row["messages"]]
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|pad|>",
                                   bos_token=None, unk_token=None, model_max_length=512)
    fast.chat_template = CHAT_TEMPLATE
    tiny = OUT / "tiny-llama"
    fast.save_pretrained(tiny)

    config = LlamaConfig(vocab_size=len(fast), hidden_size=128, intermediate_size=352, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id,
                         initializer_range=0.1,  # large random weights: richer random features, so even
                         # LoRA on a random base visibly learns the data within a minute (measured: 6.9 -> 2.3)
                         bos_token_id=None)
    config.save_pretrained(tiny)
    print(f"wrote {len(rows)} examples, vocab {len(fast)}, to {OUT}")


if __name__ == "__main__":
    main()

import pytest
import torch

# The test models are tiny: with two threads, every op pays thread hand-off costs that dwarf the work (10x slower
# here when the other core is busy). One thread keeps the suite fast and its timings stable.
torch.set_num_threads(1)


CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="session")
def chat_tokenizer():
    """
    A tiny real byte-level BPE tokenizer with ChatML special tokens and chat template, built in code (no Hub access).

    Byte-level BPE decodes back to the exact text (newlines included), so tests can compare decoded tokens with
    message contents. Special tokens: `<pad>` (0, pad), `<|im_start|>` (1), `<|im_end|>` (2, eos / end-of-turn).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [
        "You are a helpful assistant.",
        "Hello there! How are you today?",
        "I am fine, thank you. And you?",
        "What is two plus two? Two plus two is four.",
        "Tell me a short joke about cats and dogs.",
        "system user assistant",
    ]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<pad>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus * 4, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer

"""Byte-level BPE tokenizer trained on the built-in corpus."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pdstack.tiny_model import params

if TYPE_CHECKING:  # heavy imports stay lazy so the constants are cheap to import
    from transformers import PreTrainedTokenizerFast


def build_tokenizer(out_dir: Path) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on CORPUS: any text encodes without unknowns."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.trainers import BpeTrainer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=params.TOKENIZER_VOCAB_SIZE,
        min_frequency=1,
        special_tokens=list(params.SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(params.CORPUS.splitlines(), trainer=trainer)
    bos_id = tok.token_to_id(params.BOS_TOKEN)
    # Prepend BOS like DeepSeek tokenizers do, so prompts start the same way.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{params.BOS_TOKEN} $A",
        pair=f"{params.BOS_TOKEN} $A $B",
        special_tokens=[(params.BOS_TOKEN, bos_id)],
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=params.BOS_TOKEN,
        eos_token=params.EOS_TOKEN,
        pad_token=params.PAD_TOKEN,
        model_max_length=params.MAX_POSITION_EMBEDDINGS,
        chat_template=params.CHAT_TEMPLATE,
    )
    fast.save_pretrained(out_dir)
    return fast


# The config fields of params.SPECIAL_TOKENS, in order.
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def special_ids(tokenizer: PreTrainedTokenizerFast) -> dict[str, int]:
    ids = tokenizer.convert_tokens_to_ids(list(params.SPECIAL_TOKENS))
    return dict(zip(SPECIAL_IDS, ids, strict=True))

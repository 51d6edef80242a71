"""Deterministic English-like text: the emulated model's answers and the workloads' prompts.

Every piece this module yields (`` word``, ``Word``, ``,``, ``.``) is exactly one token of
``simulator.tokenizer``, so an answer of N pieces is N completion tokens, and a prompt can be
sized in tokens without tokenizing it.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from itertools import islice

from simulator.tokenizer import MAX_LETTERS_PER_TOKEN

# Common English words; those longer than MAX_LETTERS_PER_TOKEN letters are left out so every
# word is one token.
_WORD_TEXT = """
    the of and to in is that for it as was with be by on not he this are or his from at
    which but have an they you were her she there one all we their has been if more when will
    would who so no can said about into its time only other could new some these two may
    first then do any like my now over such our man me even most made after also did many
    before must well back years where much your way down should should because each just those
    people how too little state good very make world still own see men work long here get both
    between life being under never day same another know while last might us great old year
    off come since again around came right used take three states himself few house use during
    without place how american found went part once general high upon school every don does
    got united left number course war until always away fact though water less public put
    think almost hand enough far took head yet system better set told nothing night end why
    called didn eyes find going look asked later knew point next city give group toward young
    let room side social given present order kind within need often week second thus face
    best least cache model token region route node queue batch prompt answer server metric
    latency network request stream policy fleet client result data value level rate score
    """
_WORD_SOURCE = tuple(dict.fromkeys(_WORD_TEXT.split()))
WORDS: tuple[str, ...] = tuple(word for word in _WORD_SOURCE if len(word) <= MAX_LETTERS_PER_TOKEN)


def sentence_pieces(rng: random.Random) -> Iterator[str]:
    """An endless stream of sentences of 6-18 words, as one-token pieces."""
    words = WORDS
    first = True
    while True:
        length = rng.randint(6, 18)
        comma_at = rng.randint(3, length - 2) if length > 9 and rng.random() < 0.5 else -1
        for i in range(length):
            word = words[rng.randrange(len(words))]
            if i == 0:
                yield word.capitalize() if first else " " + word.capitalize()
                first = False
            else:
                yield " " + word
            if i == comma_at:
                yield ","
        yield "."


def answer_pieces(seed: int) -> Iterator[str]:
    """The emulated model's answer for a prompt whose digest is ``seed``: one piece per token."""
    return sentence_pieces(random.Random(seed))


def text_of_tokens(rng: random.Random, num_tokens: int) -> str:
    """English-like text of exactly ``num_tokens`` tokens."""
    return "".join(islice(sentence_pieces(rng), num_tokens))

"""Training text made here: the target answers many prompts, and what it says is what a
drafter must learn to predict (no data-set hub, no other model).

Prompts come from three places, none of them the benchmark sets unless the caller passes
them (the published drafters are trained without MT-bench and Alpaca, which stay held out):
  * templates: task phrasings (explain, write, compare, solve, code...) crossed with topics;
  * self-instruct: the target itself is asked for a question on a topic, sampled at T=1;
  * prompt files given by the caller (JSONL with a `turns` list, as MT-bench's question file;
    docs/benchmarks.md names the sets).

The target then answers each prompt in batches (left-padded `generate`), cycling through a
list of temperatures (greedy and T=1 by default: a drafter serves both). Answers are kept
in shards under the work directory, so an interrupted run resumes where it stopped:
    WORK/prompts.json            the prompt texts, fixed at the first run
    WORK/shard-00000.safetensors tokens (flat int32), offsets, prompt_lens, per shard
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from specd.errors import InvalidRequest
from specd.runtime.loading import LoadedModel

TEMPLATES = (
    "Explain {t} to a beginner.",
    "What are the most common misconceptions about {t}?",
    "Write a short story that involves {t}.",
    "Write a poem about {t}.",
    "Give me five practical tips about {t}.",
    "Compare {t} with a related idea and list the key differences.",
    "Summarize the history of {t} in one paragraph.",
    "Write a persuasive essay arguing that {t} matters.",
    "What questions should I ask an expert on {t}?",
    "Describe a typical day for someone who works with {t}.",
    "Write an email to a colleague proposing a project on {t}.",
    "What are the pros and cons of {t}?",
    "Create a step-by-step plan to learn about {t} in a month.",
    "Write a dialogue between two friends discussing {t}.",
    "Give three examples of {t} in everyday life and explain each.",
    "Write a product description for something related to {t}.",
    "What would the world look like in 50 years because of {t}?",
    "Write a tweet and a blog post title about {t}.",
    "Create a quiz with three questions about {t}, with answers.",
    "Pretend you are a teacher. Give a lesson on {t}.",
    "Write Python code that models a simple aspect of {t}, with comments.",
    "Solve a simple math word problem involving {t} and show your reasoning.",
    "List the steps to solve a common problem related to {t}.",
    "Rewrite this sentence to be more formal: 'I think {t} is kind of cool.'",
)

TOPICS = (
    "photosynthesis", "the stock market", "machine learning", "climate change", "the Roman Empire",
    "healthy eating", "time management", "black holes", "public speaking", "electric cars",
    "the water cycle", "remote work", "vaccines", "the French Revolution", "recycling",
    "meditation", "social media", "quantum computing", "gardening", "personal finance",
    "the human heart", "volcanoes", "chess", "renewable energy", "the internet",
    "sleep", "coffee", "cybersecurity", "the Olympic Games", "bees",
    "inflation", "databases", "the Moon landing", "friendship", "job interviews",
    "mountains", "jazz music", "prime numbers", "probability", "sorting algorithms",
    "the immune system", "ancient Egypt", "urban planning", "coral reefs", "smartphones",
    "democracy", "marathon training", "cooking pasta", "learning a new language", "video games",
    "the Renaissance", "earthquakes", "customer service", "robots", "hiking",
    "the solar system", "budget travel", "dinosaurs", "startups", "photography",
    "Shakespeare", "negotiation", "the periodic table", "dogs", "cloud computing",
    "air pollution", "the printing press", "poetry", "nutrition labels", "leadership",
    "geometry", "rain forests", "museums", "open source software", "ocean tides",
    "the history of money", "pandemics", "board games", "architecture", "happiness",
)

SELF_INSTRUCT = ("Write one question that someone might ask an AI assistant about {t}. "
                 "Reply with the question only.")


@dataclass
class Answered:
    ids: list[int]  # prompt + answer
    prompt_len: int


def template_prompts(seed: int = 0) -> list[str]:
    """Every template crossed with every topic, in a seeded order."""
    prompts = [tpl.format(t=topic) for tpl in TEMPLATES for topic in TOPICS]
    random.Random(seed).shuffle(prompts)
    return prompts


def file_prompts(paths: Sequence[Path]) -> list[str]:
    """Every turn of every line of JSONL prompt files."""
    out = []
    for path in paths:
        for n, line in enumerate(Path(path).read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                turns = json.loads(line)["turns"]
            except (ValueError, KeyError, TypeError):
                raise InvalidRequest("prompts", f"{path}:{n}: expected a JSON object with 'turns'") from None
            out.extend(t for t in turns if isinstance(t, str) and t.strip())
    return out


def _encode(target: LoadedModel, prompts: Sequence[str], chat: bool) -> list[list[int]]:
    return [target.encode_prompt(p, chat) for p in prompts]


@torch.inference_mode()
def batched_generate(target: LoadedModel, prompts: Sequence[Sequence[int]], temperature: float,
                     max_new_tokens: int, seed: int) -> list[list[int]]:
    """The target's answers (generated ids, cut after the first EOS) to a batch of prompts."""
    model = target.model
    pad = model.generation_config.pad_token_id
    eos = sorted(target.eos_token_ids)
    pad = pad if pad is not None else (eos[0] if eos else 0)
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding: every row's next token is at column `width`
        ids[i, width - len(p):] = torch.tensor(list(p))
        mask[i, width - len(p):] = 1
    kwargs = {"do_sample": temperature > 0, "max_new_tokens": max_new_tokens, "pad_token_id": pad,
              "eos_token_id": eos or None}
    if temperature > 0:
        kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
        torch.manual_seed(seed)
    kwargs.update(target.emitted_only())  # as specd's target: no id past the tokenizer's
    out = model.generate(ids.to(target.device), attention_mask=mask.to(target.device), **kwargs)
    answers = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in target.eos_token_ids), len(row))
        answers.append(row[:cut])
    return answers


def self_instruct_prompts(target: LoadedModel, n: int, batch_size: int, seed: int) -> list[str]:
    """Up to n questions written by the target itself (T=1), on a seeded random topic each
    (answers that are not one line of 10-300 characters are dropped)."""
    rng = random.Random(seed)
    asks = [SELF_INSTRUCT.format(t=rng.choice(TOPICS)) for _ in range(n)]
    out = []
    for start in tqdm(range(0, n, batch_size), desc="self-instruct prompts", unit="batch"):
        chunk = _encode(target, asks[start:start + batch_size], chat=True)
        for ans in batched_generate(target, chunk, 1.0, 48, seed + start):
            text = target.decode(ans).strip().split("\n")[0].strip()
            if 10 <= len(text) <= 300:
                out.append(text)
    return out


class Corpus:
    """The shards of a work directory: answered prompts, as (prompt + answer, prompt_len)."""

    def __init__(self, work_dir: Path):
        self.dir = Path(work_dir)

    def shards(self) -> list[Path]:
        return sorted(self.dir.glob("shard-*.safetensors"))

    def __iter__(self) -> Iterator[Answered]:
        for path in self.shards():
            yield from read_shard(path)

    def positions(self) -> int:
        """Generated tokens (the positions a drafter learns from) over all shards."""
        total = 0
        for path in self.shards():
            t = load_file(str(path))
            total += int(t["offsets"][-1]) - int(t["prompt_lens"].sum())
        return total


def write_shard(path: Path, seqs: Sequence[Answered], temperature: float) -> None:
    tokens = torch.tensor([t for s in seqs for t in s.ids], dtype=torch.int32)
    lengths = torch.tensor([0] + [len(s.ids) for s in seqs], dtype=torch.int64)
    tmp = path.with_suffix(".tmp")
    save_file({"tokens": tokens, "offsets": lengths.cumsum(0),
               "prompt_lens": torch.tensor([s.prompt_len for s in seqs], dtype=torch.int32)},
              str(tmp), metadata={"temperature": str(temperature)})
    tmp.replace(path)  # a shard is there whole or not at all: resuming never reads half of one


def read_shard(path: Path) -> list[Answered]:
    t = load_file(str(path))
    tokens, offsets, plens = t["tokens"].tolist(), t["offsets"].tolist(), t["prompt_lens"].tolist()
    return [Answered(tokens[offsets[i]:offsets[i + 1]], plens[i]) for i in range(len(plens))]


def answer_prompts(target: LoadedModel, texts: Sequence[str], temperature: float, max_new_tokens: int,
                   batch_size: int, seed: int = 0, chat: bool = True) -> list[Answered]:
    """The target's answer to every prompt (one pass, no shards): held-out evaluation sets."""
    out = []
    for start in tqdm(range(0, len(texts), batch_size), desc="target answers (eval)", unit="batch"):
        encoded = _encode(target, texts[start:start + batch_size], chat)
        answers = batched_generate(target, encoded, temperature, max_new_tokens, seed + start)
        out.extend(Answered(p + a, len(p)) for p, a in zip(encoded, answers) if a)
    return out


def build_corpus(target: LoadedModel, work_dir: Path, positions: int, *, prompt_files: Sequence[Path] = (),
                 self_instruct: int = 0, temperatures: Sequence[float] = (0.0, 1.0), batch_size: int = 32,
                 max_new_tokens: int = 256, seed: int = 0, chat: bool = True) -> Corpus:
    """Answer prompts until the corpus holds at least `positions` generated tokens.

    The prompt list is fixed on the first run (WORK/prompts.json); shard i answers batch i of
    it (cycling, so a prompt is answered again at another temperature or seed when more
    positions are asked for than one pass gives). Existing shards are kept."""
    if positions < 1:
        raise InvalidRequest("positions", f"must be at least 1, got {positions}")
    if batch_size < 1:
        raise InvalidRequest("batch_size", f"must be at least 1, got {batch_size}")
    if max_new_tokens < 1:  # every answer then holds a token (an EOS at least): the loop ends
        raise InvalidRequest("max_new_tokens", f"must be at least 1, got {max_new_tokens}")
    if not temperatures or any(t < 0 for t in temperatures):
        raise InvalidRequest("temperatures", "needs one or more temperatures >= 0")
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    corpus = Corpus(work_dir)
    listing = work_dir / "prompts.json"
    if listing.is_file():
        prompts = json.loads(listing.read_text())
    else:
        prompts = template_prompts(seed) + file_prompts(prompt_files)
        if self_instruct:
            prompts += self_instruct_prompts(target, self_instruct, batch_size, seed)
        random.Random(seed).shuffle(prompts)
        listing.write_text(json.dumps(prompts, indent=0))
    have = corpus.positions()
    index = len(corpus.shards())
    bar = tqdm(total=positions, initial=min(have, positions), desc="target answers", unit="tok")
    while have < positions:
        start = (index * batch_size) % len(prompts)
        texts = [prompts[(start + i) % len(prompts)] for i in range(batch_size)]
        encoded = _encode(target, texts, chat)
        temperature = temperatures[index % len(temperatures)]
        answers = batched_generate(target, encoded, temperature, max_new_tokens, seed + index)
        seqs = [Answered(p + a, len(p)) for p, a in zip(encoded, answers) if a]
        write_shard(work_dir / f"shard-{index:05d}.safetensors", seqs, temperature)
        added = sum(len(a) for a in answers)
        have += added
        bar.update(min(added, max(0, positions - bar.n)))
        index += 1
    bar.close()
    return corpus

"""The shared benchmark workload: seeded, chat-templated English prompts of varied length and
exact per-request output lengths. Needs only the model's tokenizer (no torch model, no Redis).
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass
from typing import Any

SYSTEM_PROMPT = "You are a helpful assistant."

# Short tasks: a whole prompt on their own, or the instruction in front of a document.
INSTRUCTIONS = [
    "Summarize the following text in three sentences.",
    "List the main points of this passage as bullet points.",
    "Rewrite the text below in plain language for a ten-year-old.",
    "Translate the following paragraph into French.",
    "Write a short title for the text below and explain your choice.",
    "Find any factual claims in this passage that would need a source.",
    "Turn the following notes into a polite email to a colleague.",
    "Explain what the author is arguing and whether the argument holds.",
    "Extract every date, person and place mentioned in the text.",
    "Write three quiz questions, with answers, about the passage below.",
    "Continue the story below for another paragraph, keeping the same tone.",
    "Point out the weakest sentence in this text and improve it.",
]

QUESTIONS = [
    "What is the difference between weather and climate?",
    "How does a refrigerator keep food cold?",
    "Why do cats purr?",
    "Give me a simple recipe for pancakes.",
    "What are three tips for learning a new language?",
    "Explain recursion to a beginner programmer.",
    "How far away is the Moon, roughly?",
    "Write a haiku about autumn rain.",
    "What causes the seasons on Earth?",
    "Suggest a name for a small bakery by the sea.",
    "How do vaccines train the immune system?",
    "What should I pack for a two-day hiking trip?",
    "Why is the sky blue during the day and red at sunset?",
    "Describe the water cycle in a few sentences.",
    "What is a prime number? Give five examples.",
    "How can I make my mornings less rushed?",
]

DOCUMENT_SENTENCES = [
    "The village sat at the edge of a wide valley, where the river slowed and spread into marshland.",
    "Every spring the farmers argued about the water, because the upstream fields always took more than their share.",
    "In 1887 a surveyor named Henrik Alm mapped the valley and proposed a system of small canals.",
    "His plan was ignored for twenty years, until a drought ruined two harvests in a row.",
    "The new canals were dug by hand, mostly in winter, when there was little other work to do.",
    "Modern processors spend much of their time waiting for data to arrive from main memory.",
    "Caches keep recently used data close to the core, so that a second access is far cheaper than the first.",
    "Programs that walk memory in order benefit the most, because the hardware can prefetch the next lines.",
    "A linked list scattered across the heap defeats the prefetcher and can run ten times slower than an array.",
    "Our quarterly revenue grew by eight percent, driven mainly by the new subscription plans.",
    "Support tickets fell after the redesign of the onboarding screens, although churn stayed roughly flat.",
    "The board asked the team to focus next quarter on reliability rather than on new features.",
    "Honeybees communicate the direction of food with a waggle dance performed on the vertical comb.",
    "The angle of the dance relative to gravity encodes the angle of the flowers relative to the sun.",
    "Longer waggle runs mean the food is farther away, so other foragers can judge the distance.",
    "The meeting on Tuesday ran late because nobody had prepared the budget figures in advance.",
    "Maria suggested that each team send a one-page summary before the next session.",
    "Tom disagreed and said summaries would only add paperwork without changing the outcome.",
    "Bread rises because yeast ferments sugars and releases carbon dioxide into the dough.",
    "Gluten forms an elastic network that traps the gas and lets the loaf hold its shape.",
    "A longer, cooler rise develops more flavour, which is why many bakers leave dough overnight.",
    "The old lighthouse was automated in 1962, and the keeper's cottage became a small museum.",
    "Visitors can climb the one hundred and twelve steps to the lamp room on summer weekends.",
    "On clear days the coast of the neighbouring island is visible from the gallery.",
    "Solar panels convert sunlight into electricity using layers of specially treated silicon.",
    "Their output drops on hot days, because the efficiency of the cells falls as temperature rises.",
    "Batteries let households store midday surplus and use it in the evening instead of buying power.",
    "The committee reviewed forty applications and invited six candidates for a second interview.",
    "Two of the candidates had strong technical records but little experience leading a team.",
    "The final decision was postponed until the references could be checked.",
    "Octopuses can change both the colour and the texture of their skin in a fraction of a second.",
    "Each arm contains a large share of the animal's neurons and can react on its own.",
    "Researchers still debate how much of this behaviour is planned and how much is reflex.",
    "The train left the station twelve minutes late, and the connection in the city was missed.",
    "Passengers were offered vouchers, but the queue at the service desk was over an hour long.",
    "A later train was added in the evening, which most travellers learned about only from social media.",
    "Composting turns kitchen scraps and garden waste into a dark, crumbly soil improver.",
    "A good heap needs a mix of green material, rich in nitrogen, and brown material, rich in carbon.",
    "Turning the heap every few weeks lets air in and speeds up the work of the microbes.",
    "The novel follows two sisters who inherit a failing hotel on a remote northern coast.",
    "Over one long winter they repair the building, and slowly their old rivalry resurfaces.",
    "The ending leaves open whether the hotel, or the family, will survive the next season.",
]


@dataclass
class WorkItem:
    """One benchmark request."""

    index: int
    text: str  # the user message
    prompt_token_ids: list[int]  # chat-templated, with the generation prompt
    max_tokens: int  # exact output length (EOS ignored)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


def output_lengths(num: int, rng: random.Random, mean: float = 100.0, sigma: float = 0.8,
                   low: int = 8, high: int = 512) -> list[int]:
    """Lognormal output lengths clipped to ``low..high`` (``mean`` is the unclipped mean)."""
    mu = math.log(mean) - sigma**2 / 2
    return [max(low, min(high, round(rng.lognormvariate(mu, sigma)))) for _ in range(num)]


def _template(tokenizer: Any, text: str) -> list[int]:
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": text}]
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
    return [int(t) for t in ids]


def _user_text(rng: random.Random, tokenizer: Any, target_tokens: int) -> tuple[str, list[int]]:
    """A question (short targets) or an instruction over a document grown to ``target_tokens``."""
    question = rng.choice(QUESTIONS)
    ids = _template(tokenizer, question)
    if len(ids) >= target_tokens - 10:
        return question, ids
    instruction = rng.choice(INSTRUCTIONS)
    start = rng.randrange(len(DOCUMENT_SENTENCES))
    sentences: list[str] = []
    text, ids = instruction, _template(tokenizer, instruction)
    while len(ids) < target_tokens:
        sentences.append(DOCUMENT_SENTENCES[(start + len(sentences)) % len(DOCUMENT_SENTENCES)])
        candidate = instruction + "\n\n" + " ".join(sentences)
        candidate_ids = _template(tokenizer, candidate)
        if len(candidate_ids) > target_tokens + 8 and sentences[:-1]:
            break  # stop just under the target rather than far over it
        text, ids = candidate, candidate_ids
    return text, ids


def build_workload(tokenizer: Any, num_requests: int = 64, seed: int = 0, min_prompt_tokens: int = 20,
                   max_prompt_tokens: int = 300, mean_output_tokens: float = 100.0,
                   max_output_tokens: int = 512) -> list[WorkItem]:
    """Seeded requests: prompt lengths log-uniform in ``min..max_prompt_tokens``, output
    lengths lognormal clipped to ``8..max_output_tokens``.

    Args:
        tokenizer: the model's tokenizer (its chat template is applied).
        num_requests: how many requests.
        seed: one seed for prompts and lengths; same seed, same workload.

    Returns:
        The requests, in submission order.
    """
    rng = random.Random(seed)
    lengths = output_lengths(num_requests, rng, mean=mean_output_tokens, high=max_output_tokens)
    items = []
    for index in range(num_requests):
        target = round(math.exp(rng.uniform(math.log(min_prompt_tokens), math.log(max_prompt_tokens))))
        text, ids = _user_text(rng, tokenizer, target)
        items.append(WorkItem(index, text, ids, lengths[index]))
    return items


def describe(items: list[WorkItem]) -> dict[str, Any]:
    """Summary numbers of a workload, for the report."""
    prompts = [item.num_prompt_tokens for item in items]
    outputs = [item.max_tokens for item in items]
    return {
        "num_requests": len(items),
        "prompt_tokens": {"min": min(prompts), "mean": sum(prompts) / len(prompts), "max": max(prompts),
                          "total": sum(prompts)},
        "output_tokens": {"min": min(outputs), "mean": sum(outputs) / len(outputs), "max": max(outputs),
                          "total": sum(outputs)},
    }


def to_json(items: list[WorkItem]) -> list[dict[str, Any]]:
    return [asdict(item) for item in items]


def from_json(rows: list[dict[str, Any]]) -> list[WorkItem]:
    return [WorkItem(**row) for row in rows]

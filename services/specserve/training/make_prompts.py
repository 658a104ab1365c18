"""Write the shipped training prompt sets (``prompts/{chat,code,summarize}.jsonl``).

The sets are synthesized from templates and subject lists (no network, nothing downloaded),
seeded, so ``python -m specserve.training.make_prompts`` rewrites the same files. They are the
*inputs* of self-distillation: the draft learns from what the target answers to them, so they
only need to look like the traffic the draft will see, not to have good answers themselves.
The held-out evaluation prompts (``load/prompts/chat.jsonl``, hand-written) are not among
them; ``tests/training`` checks that.
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

HERE = Path(__file__).parent / "prompts"

EXPLAIN = [
    "photosynthesis", "inflation", "black holes", "the water cycle", "compound interest",
    "how a refrigerator keeps food cold", "plate tectonics", "the stock market", "machine learning",
    "how the internet routes a message", "the greenhouse effect", "DNA replication", "supply and demand",
    "how airplanes stay in the air", "the French Revolution", "how batteries store energy",
    "why we dream", "the theory of evolution", "how credit scores work", "quantum computing",
    "how a bill becomes a law", "the causes of earthquakes", "antibiotic resistance", "how solar panels work",
    "the Roman Empire's fall", "how memory works in the brain", "blockchain", "ocean tides",
    "how search engines rank pages", "the immune system's fever response", "electric cars",
    "the difference between a virus and a bacterium", "why leaves change color in autumn",
    "how GPS finds your position", "the Industrial Revolution", "recycling plastic", "how wind turbines work",
    "the placebo effect", "how coffee affects the body", "rainbows", "how encryption protects data",
    "the Renaissance", "how muscles grow", "interest rates", "the moon's phases", "how vaccines are tested",
    "volcanoes", "how a car engine works", "the Cold War", "how noise-cancelling headphones work",
    "gravity", "how bees make honey", "the printing press", "sleep cycles", "how taxes fund a city",
    "how a microwave oven heats food", "the Great Wall of China", "time zones", "how bridges carry weight",
    "why the ocean is salty", "how a camera captures light", "the carbon cycle", "operating systems",
]
EXPLAIN_T = [
    "Explain {s} in simple terms.", "Can you explain {s} to a ten-year-old?",
    "What is the basic idea behind {s}?", "Give me a short overview of {s}.",
    "I never understood {s}. Could you walk me through it?", "Why does {s} matter?",
    "What are the most common misconceptions about {s}?", "Describe {s} in three paragraphs.",
    "Summarize the key facts about {s} in a few bullet points.", "How would you teach {s} to a beginner?",
]
HOWTO = [
    "bake a loaf of bread", "start running as a beginner", "write a resume", "plan a week of healthy meals",
    "train a puppy to sit", "fix a leaking faucet", "prepare for a math exam", "start a vegetable garden",
    "organize a small closet", "negotiate a higher salary", "learn to play the guitar", "make a budget",
    "give a good presentation", "meditate for the first time", "clean a laptop keyboard", "brew good coffee",
    "plan a road trip", "improve my handwriting", "take better photos with my phone", "paint a room",
    "write a thank-you note", "set up a home office", "study for long hours without burning out",
    "start journaling", "cook rice on the stove", "change a bicycle tire", "learn to swim as an adult",
    "host a dinner party", "make friends in a new city", "back up my computer", "reduce my screen time",
    "write a short speech for a wedding", "keep a sourdough starter alive", "care for a cactus",
    "prepare for a marathon", "make a paper airplane that flies far", "clean a cast iron pan",
    "memorize a poem", "start investing with little money", "learn to draw faces",
]
HOWTO_T = [
    "How do I {s}?", "What is the best way to {s}?", "Give me step-by-step instructions to {s}.",
    "I want to {s}. Where should I begin?", "What mistakes should I avoid when I {s}?",
    "Can you give me five tips to {s}?",
]
ADVICE = [
    "I feel tired every afternoon at work", "my roommate never cleans the kitchen",
    "I can't decide between two job offers", "I get nervous before speaking in meetings",
    "my teenager spends all day on the phone", "I want to change careers at forty",
    "I have trouble falling asleep", "my team keeps missing deadlines", "I spend too much on takeout",
    "I forget people's names right after meeting them", "my garden tomatoes keep splitting",
    "I want to read more books this year", "my neighbor's dog barks all night",
    "I get distracted when working from home", "I'm moving abroad next month",
    "my old laptop is very slow", "I argue with my sister about small things",
    "I want to eat less sugar", "I have a long commute every day", "my cat scratches the sofa",
]
ADVICE_T = [
    "{s}. What should I do?", "{s}. Any advice?", "Help me think this through: {s}.",
    "{s}. What are my options?",
]
STORY = [
    "a robot learning to paint", "a girl who can talk to birds", "a lost key that opens any door",
    "two friends on a camping trip", "a baker who bakes bread that grants wishes", "a city under the sea",
    "an old clock that runs backwards", "a detective cat", "the last tree in a desert town",
    "a shy giant", "a spaceship crew finding a new planet", "a library that appears only at night",
    "a fox who wants to be a musician", "a boy who collects storms", "a time traveler stuck in 1850",
    "a snowman who wants to see summer", "a pirate who is afraid of water", "a garden that grows stars",
    "a mail carrier on the moon", "a village of tiny inventors",
]
STORY_T = [
    "Write a short story about {s}.", "Tell me a story about {s}.", "Write a poem about {s}.",
    "Write a fairy tale about {s}.", "Write a funny story about {s} in under 200 words.",
]
COMPARE = [
    ("cats", "dogs"), ("tea", "coffee"), ("renting", "buying a home"), ("trains", "planes"),
    ("Python", "Java"), ("running", "swimming"), ("e-books", "paper books"), ("city life", "country life"),
    ("stocks", "bonds"), ("electric cars", "hybrid cars"), ("summer", "winter"), ("laptops", "desktops"),
    ("SQL", "NoSQL databases"), ("nuclear power", "solar power"), ("walking", "cycling to work"),
]
COMPARE_T = [
    "What are the pros and cons of {a} versus {b}?", "Compare {a} and {b}.",
    "Which is better, {a} or {b}? Explain your reasoning.",
]

LANGUAGES = ["Python", "JavaScript", "Go", "Rust", "Java", "C", "TypeScript", "Bash", "SQL", "C++"]
TASKS = [
    "reverses a linked list", "counts the words in a string", "checks whether a number is prime",
    "finds the largest element in a list", "removes duplicates from a list while keeping order",
    "converts Celsius to Fahrenheit", "computes the factorial of n", "returns the n-th Fibonacci number",
    "sorts a list of numbers with bubble sort", "checks if two strings are anagrams",
    "flattens a nested list", "parses a date string like 2024-05-01", "reads a CSV file and sums a column",
    "validates an email address", "computes the average of a list", "implements binary search",
    "counts vowels in a sentence", "merges two dictionaries", "finds the longest word in a sentence",
    "rotates a matrix by 90 degrees", "checks whether parentheses are balanced", "implements a stack",
    "implements a queue with two stacks", "computes the greatest common divisor", "converts a number to binary",
    "capitalizes the first letter of every word", "returns the second largest number in a list",
    "generates all permutations of a string", "finds the intersection of two lists",
    "computes the sum of the digits of a number", "checks if a year is a leap year",
    "counts how often each character appears", "returns the median of a list", "implements FizzBuzz",
    "truncates a string to n characters with an ellipsis", "groups a list of words by their first letter",
]
CODE_T = [
    "Write a {lang} function that {task}.", "In {lang}, write code that {task}.",
    "Show me a {lang} example that {task}, with comments.",
    "Write a {lang} function that {task}, and explain how it works.",
]
CODE_EXTRA = [
    "What does this Python code print?\n\nfor i in range(3):\n    print(i * {n})",
    "Explain the difference between a list and a tuple in Python, with an example using {n} items.",
    "Write a SQL query that returns the {n} most recent orders from a table called orders.",
    "Write a regular expression that matches a number with exactly {n} digits, and explain it.",
]

FACTS = {
    "the octopus": ["Octopuses have three hearts and blue blood.", "They can change color in a fraction of a second.",
                    "Each arm contains a large share of the animal's neurons.", "Most octopuses live only one or two years.",
                    "They are known to open jars and escape from tanks.", "Octopuses squirt ink to confuse predators."],
    "the city of Venice": ["Venice is built on more than one hundred small islands.", "Canals serve as its main streets.",
                           "The city has sunk slowly over the centuries.", "Tourism is its most important industry.",
                           "Flooding known as acqua alta happens most winters.", "A barrier system now protects the lagoon."],
    "urban cycling": ["Many cities have added protected bike lanes.", "Cycling reduces traffic and air pollution.",
                      "Bike-sharing schemes let people rent bikes by the minute.", "Safety concerns keep some people from cycling.",
                      "Electric bikes make hills and long distances easier.", "Studies link regular cycling to better health."],
    "coffee farming": ["Coffee grows best in tropical highlands.", "Most coffee is grown by small family farms.",
                       "Prices on world markets change a lot from year to year.", "Climate change threatens many growing regions.",
                       "Arabica and robusta are the two main species.", "Beans are picked, dried, and roasted before sale."],
    "remote work": ["Remote work grew quickly after 2020.", "Many workers value the time saved on commuting.",
                    "Some managers worry about collaboration and training.", "Video calls replaced many in-person meetings.",
                    "Companies have reduced their office space.", "Hybrid schedules mix office and home days."],
    "the Antarctic": ["Antarctica is the coldest continent on Earth.", "It holds most of the world's fresh water as ice.",
                      "No country owns it; a treaty governs its use.", "Scientists live at research stations year-round.",
                      "Penguins and seals live along its coasts.", "Its ice sheets are losing mass as the climate warms."],
    "public libraries": ["Libraries lend books, films, and digital media for free.", "Many offer free internet access.",
                         "They host classes, reading groups, and children's events.", "Budgets have been cut in many towns.",
                         "Librarians help people find reliable information.", "Some libraries now lend tools and instruments."],
    "honey production": ["A colony can produce dozens of kilograms of honey a year.", "Bees turn nectar into honey by evaporation.",
                         "Beekeepers leave enough honey for bees to survive winter.", "Honey never spoils if it is sealed.",
                         "Its flavor depends on the flowers the bees visit.", "Pesticides and disease have hurt bee populations."],
    "sleep science": ["Adults need about seven to nine hours of sleep.", "Sleep moves through light, deep, and REM stages.",
                      "Screens before bed can delay sleep.", "Lack of sleep harms memory and mood.",
                      "A regular schedule helps the body clock.", "Naps shorter than thirty minutes can restore alertness."],
    "electric grids": ["Power grids balance supply and demand every second.", "Solar and wind output varies with the weather.",
                       "Batteries can store energy for hours.", "Old transmission lines limit how much power can move.",
                       "Smart meters report use in real time.", "Blackouts can start from a single failure."],
}
SUMMARIZE_T = [
    "Summarize this text:\n\n{p}", "Summarize the following paragraph in one sentence:\n\n{p}",
    "Give me the main points of this passage:\n\n{p}", "Write a short summary of this text:\n\n{p}",
]


def _chat(rng: random.Random) -> list[dict]:
    rows = [(t.format(s=s), "explain") for t, s in itertools.product(EXPLAIN_T, EXPLAIN)]
    rows += [(t.format(s=s), "howto") for t, s in itertools.product(HOWTO_T, HOWTO)]
    rows += [(t.format(s=s), "advice") for t, s in itertools.product(ADVICE_T, ADVICE)]
    rows += [(t.format(s=s), "story") for t, s in itertools.product(STORY_T, STORY)]
    rows += [(t.format(a=a, b=b), "compare") for t, (a, b) in itertools.product(COMPARE_T, COMPARE)]
    rng.shuffle(rows)
    return [_row(text, cat) for text, cat in rows]


def _code(rng: random.Random) -> list[dict]:
    rows = [(t.format(lang=lang, task=task), lang.lower())
            for t, lang, task in itertools.product(CODE_T, LANGUAGES, TASKS)]
    rows += [(t.format(n=n), "explain") for t, n in itertools.product(CODE_EXTRA, range(2, 12))]
    rng.shuffle(rows)
    return [_row(text, cat) for text, cat in rows[:600]]


def _summarize(rng: random.Random) -> list[dict]:
    rows = []
    for topic, facts in FACTS.items():
        for _ in range(24):
            picked = rng.sample(facts, rng.randint(3, len(facts)))
            passage = f"This passage is about {topic}. " + " ".join(picked)
            rows.append((rng.choice(SUMMARIZE_T).format(p=passage), "summarize"))
    rng.shuffle(rows)
    return [_row(text, cat) for text, cat in rows]


def _row(text: str, category: str) -> dict:
    return {"messages": [{"role": "user", "content": text}], "category": category}


def main() -> None:
    HERE.mkdir(exist_ok=True)
    for name, make in (("chat", _chat), ("code", _code), ("summarize", _summarize)):
        rows = make(random.Random(f"specserve-{name}"))
        with open(HERE / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        print(f"{name}: {len(rows)} prompts")


if __name__ == "__main__":
    main()

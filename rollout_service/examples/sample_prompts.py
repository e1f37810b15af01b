"""The built-in prompt set used when a service config names no prompts file: short questions with
known answers (kept in `metadata`, as a reward function would need them)."""
from __future__ import annotations

SAMPLE_PROMPTS: list[dict] = [
    {"prompt": "What is the capital of France?", "metadata": {"answer": "Paris"}},
    {"prompt": "What is 7 times 8?", "metadata": {"answer": "56"}},
    {"prompt": "Name the largest planet in the solar system.", "metadata": {"answer": "Jupiter"}},
    {"prompt": "What is the chemical symbol for gold?", "metadata": {"answer": "Au"}},
    {"prompt": "How many days are there in a leap year?", "metadata": {"answer": "366"}},
    {"prompt": "Who wrote 'Romeo and Juliet'?", "metadata": {"answer": "Shakespeare"}},
    {"prompt": "What is the boiling point of water in degrees Celsius?", "metadata": {"answer": "100"}},
    {"prompt": "What is the square root of 81?", "metadata": {"answer": "9"}},
    {"prompt": "Which ocean is the largest?", "metadata": {"answer": "Pacific"}},
    {"prompt": "What gas do plants absorb from the air?", "metadata": {"answer": "carbon dioxide"}},
    {"prompt": "What is 15 plus 27?", "metadata": {"answer": "42"}},
    {"prompt": "In which continent is Kenya?", "metadata": {"answer": "Africa"}},
    {"prompt": "What is the freezing point of water in Fahrenheit?", "metadata": {"answer": "32"}},
    {"prompt": "How many sides does a hexagon have?", "metadata": {"answer": "6"}},
    {"prompt": "What is the capital of Japan?", "metadata": {"answer": "Tokyo"}},
    {"prompt": "Write one sentence about the moon.", "metadata": {"answer": None}},
]

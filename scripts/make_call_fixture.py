#!/usr/bin/env python3
"""Write fleet/probes/data/call.json: a synthetic voice-agent call for the probes and `fleet bench`.

Shaped like the calls in DOMAIN.md: a long system prompt (~28k characters, about 7k tokens), a
handful of tool declarations, and 30 short caller turns. SYNTHETIC: a made-up clinic and policies.
Deterministic: running it again gives the same file.
"""

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "fleet" / "probes" / "data" / "call.json"
TOPICS = [
    "appointments",
    "cancellations",
    "insurance",
    "payments",
    "prescriptions",
    "referrals",
    "opening hours",
    "emergencies",
    "privacy",
    "accessibility",
    "languages",
    "parking",
    "test results",
    "vaccinations",
]
RULES = [
    "Confirm the caller's full name and date of birth before you discuss any {t} details.",
    "Never read out more than one {t} option at a time; wait for the caller to choose.",
    "If the caller sounds unsure about {t}, summarise what you understood in one sentence.",
    "Use the tool that matches {t} instead of guessing; say that you are checking.",
    "Keep every answer about {t} under two short sentences: the caller is listening, not reading.",
    "When {t} depends on the doctor's schedule, offer the two earliest slots first.",
    "Do not promise anything about {t} that the tools did not return.",
    "Spell out numbers that matter for {t}, such as times and amounts, slowly and clearly.",
]
USER_TURNS = [
    "Hi, I'd like to book a check-up.",
    "Next Tuesday if possible.",
    "Morning is better for me.",
    "My name is Dana Novak.",
    "Fourth of March, nineteen eighty-eight.",
    "Yes, that's right.",
    "Is the ten o'clock still free?",
    "Great, book that one.",
    "Do you take Baltic Health insurance?",
    "My policy number is BH four four one nine.",
    "How much would I pay myself?",
    "Okay, that's fine.",
    "Can I also renew a prescription?",
    "It's for my allergy tablets.",
    "The same dose as last time.",
    "Can I pick it up at the front desk?",
    "What time do you close on Tuesdays?",
    "Is there parking nearby?",
    "Do I need to bring anything?",
    "Should I come early?",
    "Can my daughter come with me?",
    "She's twelve.",
    "Sorry, can you repeat the address?",
    "Thanks. And the floor?",
    "Is there a lift?",
    "Perfect.",
    "Will I get a reminder?",
    "By text message, please.",
    "That's all, thank you.",
    "Bye!",
]
TOOLS = [
    ("find_slots", "Find free appointment slots.", {"date": "string", "part_of_day": "string"}),
    ("book_slot", "Book a slot for a patient.", {"slot_id": "string", "patient_id": "string"}),
    ("lookup_patient", "Find a patient by name and date of birth.", {"name": "string", "dob": "string"}),
    ("check_insurance", "Check coverage for a policy.", {"insurer": "string", "policy": "string"}),
    ("renew_prescription", "Request a prescription renewal.", {"patient_id": "string", "drug": "string"}),
]


def main() -> None:
    rng = random.Random(7)
    parts = [
        "You are Mila, the phone receptionist of Lindenhof Family Clinic. You speak with callers in real "
        "time; your words are turned into speech. Be warm, brief and exact."
    ]
    n = 0
    while sum(len(p) for p in parts) < 28000:
        topic = TOPICS[n % len(TOPICS)]
        rules = rng.sample(RULES, 4)
        parts.append(
            f"## {topic.title()} ({n // len(TOPICS) + 1})\n" + "\n".join(f"- {r.format(t=topic)}" for r in rules)
        )
        n += 1
    tools = [
        {
            "type": "function",
            "function": {
                "name": name,
                "description": desc,
                "parameters": {
                    "type": "object",
                    "properties": {k: {"type": v} for k, v in props.items()},
                    "required": list(props),
                },
            },
        }
        for name, desc, props in TOOLS
    ]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(
        json.dumps(
            {"synthetic": True, "system": "\n\n".join(parts), "tools": tools, "user_turns": USER_TURNS}, indent=1
        )
        + "\n"
    )
    print(f"wrote {OUT}: {sum(len(p) for p in parts)} characters of system prompt, {len(USER_TURNS)} turns")


if __name__ == "__main__":
    main()

"""A labelled set for the memory truth rules (processors/memory/truth.py): pairs of
statements one user made, the older first, each labelled with what the newer one
should do to the older:

* ``supersedes``: same subject, another value ("lives in Lisbon", later "moved to
  Berlin"): search must return the newer only.
* ``duplicate``: the same fact again, perhaps in other words: one row is kept.
* ``distinct``: two facts, both kept (many share words or a topic on purpose).

Written as a user (first person) or as the model's distillation writes (third person).
Some pairs are hard on purpose; the rules are not expected to get all of them.
"""

from __future__ import annotations

from typing import Literal

Label = Literal["supersedes", "duplicate", "distinct"]

TRUTH_PAIRS: list[tuple[str, str, Label]] = [
    # -- supersedes --
    ("I live in Lisbon.", "I moved to Berlin.", "supersedes"),
    ("I live in Lisbon, near the river.", "I now live in Berlin.", "supersedes"),
    ("The user lives in Porto.", "The user has moved to Madrid.", "supersedes"),
    ("I am based in London.", "I relocated to Dublin last month.", "supersedes"),
    ("I work as a data engineer at a bank.", "I work as a teacher now.", "supersedes"),
    ("The user works as a nurse.", "The user is now a software engineer.", "supersedes"),
    ("I work at Siemens.", "I work for a small startup now.", "supersedes"),
    ("My favourite colour is dark green.", "My favourite colour is blue.", "supersedes"),
    ("My favorite film is Spirited Away.", "My favourite film is Alien.", "supersedes"),
    ("I am vegetarian.", "I am vegan since January.", "supersedes"),
    ("I am vegetarian.", "I eat meat again.", "supersedes"),
    ("I am single.", "I got married in June.", "supersedes"),
    ("I am 34 years old.", "I turned 35 today.", "supersedes"),
    ("I drive a blue Volvo estate.", "I drive an electric Renault now.", "supersedes"),
    ("My phone is an old Pixel 6.", "My phone is an iPhone 15.", "supersedes"),
    ("My laptop is a ThinkPad X1 Carbon.", "My laptop is a MacBook Air.", "supersedes"),
    ("My sister lives in Porto.", "My sister moved to Paris.", "supersedes"),
    ("My brother works as a chef.", "My brother works as a pilot now.", "supersedes"),
    ("My dog is called Bolt.", "My dog is named Rex.", "supersedes"),
    ("My manager's name is Tomas.", "My manager's name is Ines.", "supersedes"),
    ("I prefer tea to coffee in the morning.", "I prefer coffee these days.", "supersedes"),
    ("My editor is Neovim.", "My editor is VS Code now.", "supersedes"),
    ("The user's favourite band is Radiohead.", "The user's favourite band is Muse.", "supersedes"),
    ("My home city is Coimbra.", "I live in Faro now.", "supersedes"),
    ("My team uses Kafka.", "My team uses Pulsar now.", "supersedes"),
    ("I have two cats.", "I have three cats now.", "supersedes"),
    (
        "My mortgage ends in 2041.",
        "My mortgage ends in 2039 after the extra payment.",
        "supersedes",
    ),
    ("My blood type is O negative.", "My blood type is A positive.", "supersedes"),
    # -- duplicates --
    ("I like tea.", "I like tea.", "duplicate"),
    ("I like tea.", "I really like tea.", "duplicate"),
    ("I live in Lisbon.", "i live  in LISBON.", "duplicate"),
    ("I live in Lisbon.", "I live in Lisbon now.", "duplicate"),
    ("I am allergic to peanuts.", "I'm allergic to peanuts.", "duplicate"),
    ("My favourite colour is dark green.", "My favorite color is dark green.", "duplicate"),
    ("I work as a data engineer at a bank.", "I am a data engineer at a bank.", "duplicate"),
    (
        "I work as a data engineer at a bank.",
        "I work as a data engineer at a bank now.",
        "duplicate",
    ),
    ("I run a marathon every autumn.", "I run a marathon every autumn!", "duplicate"),
    ("I have two cats called Miso and Tofu.", "I have two cats, Miso and Tofu.", "duplicate"),
    ("My birthday is on the 14th of March.", "My birthday is on 14 March.", "duplicate"),
    ("I am learning to play the cello.", "I am learning the cello.", "duplicate"),
    ("I cycle to work every day.", "I cycle to work every single day.", "duplicate"),
    ("The user is vegetarian.", "The user is a vegetarian.", "duplicate"),
    ("I support Benfica at football.", "I support Benfica.", "duplicate"),
    ("My wife is called Sofia.", "My wife is named Sofia.", "duplicate"),
    ("I am afraid of flying.", "I'm afraid of flying.", "duplicate"),
    ("I wake up at six every morning.", "I wake up at six every morning.", "duplicate"),
    ("I love drinking tea.", "I like tea.", "duplicate"),
    (
        "I read science fiction novels before bed.",
        "I read science fiction before bed.",
        "duplicate",
    ),
    ("I meditate for ten minutes after lunch.", "I meditate ten minutes after lunch.", "duplicate"),
    ("The user lives in Berlin.", "The user lives in Berlin now.", "duplicate"),
    ("I play chess online every evening.", "I play online chess every evening.", "duplicate"),
    (
        "I volunteer at an animal shelter on weekends.",
        "I volunteer at the animal shelter at weekends.",
        "duplicate",
    ),
    # -- distinct --
    ("I live in Lisbon.", "My sister lives in Porto.", "distinct"),
    ("My sister lives in Porto.", "My brother lives in Berlin.", "distinct"),
    ("I like tea.", "I like coffee.", "distinct"),
    ("I like tea.", "I like cycling.", "distinct"),
    ("I am allergic to peanuts.", "I am allergic to shellfish.", "distinct"),
    ("My wife is called Sofia.", "My wife is a doctor.", "distinct"),
    ("My wife is called Sofia.", "My son is called Tiago.", "distinct"),
    ("My dog is called Bolt.", "My cat is called Miso.", "distinct"),
    ("I work as a data engineer at a bank.", "My brother works as a chef.", "distinct"),
    ("My favourite colour is dark green.", "My favourite food is grilled sardines.", "distinct"),
    ("My favourite film is Spirited Away.", "My favourite band is Radiohead.", "distinct"),
    ("I drive a blue Volvo estate.", "My wife drives a red Fiat.", "distinct"),
    ("I live in Lisbon.", "I work in Lisbon.", "distinct"),
    ("I am vegetarian.", "I am lactose intolerant.", "distinct"),
    ("I have two cats.", "I have a dog.", "distinct"),
    ("I speak Portuguese and English.", "I am learning Japanese.", "distinct"),
    ("My phone is an old Pixel 6.", "My laptop is a ThinkPad X1 Carbon.", "distinct"),
    ("I go climbing on Tuesdays.", "I go swimming on Thursdays.", "distinct"),
    ("I run a marathon every autumn.", "I am training for a triathlon.", "distinct"),
    ("My parents live in the Alentejo.", "I live in Lisbon.", "distinct"),
    ("I studied physics at Coimbra.", "I work as a data engineer.", "distinct"),
    ("My manager's name is Tomas.", "My best friend is called Rui.", "distinct"),
    ("I grow tomatoes on my balcony.", "I grow basil on my balcony.", "distinct"),
    ("I am saving for a trip to Japan.", "I went to Japan in 2019.", "distinct"),
    ("My birthday is on the 14th of March.", "My wife's birthday is in June.", "distinct"),
    ("I wake up at six every morning.", "I go to bed at eleven.", "distinct"),
    ("I read science fiction before bed.", "I listen to podcasts on the train.", "distinct"),
    ("The user lives in Berlin.", "The user works in Potsdam.", "distinct"),
    ("The user is afraid of flying.", "The user is afraid of spiders.", "distinct"),
    ("I collect vintage fountain pens.", "I collect vinyl records.", "distinct"),
    ("My wife is called Sofia.", "My wife is very kind.", "distinct"),
    ("I use Neovim as my editor.", "I use Firefox as my browser.", "distinct"),
]

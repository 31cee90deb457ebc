"""Prompts of about N tokens for the server benches, whatever the model."""

# Common English words: with a leading space each is one token in the usual BPE vocabularies, so N words make a
# prompt of about N tokens whatever the model. The server's usage counts the real number.
WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had by word "
    "but not what all were we when your can said there use an each which she do how their if will up other about "
    "out many then them these so some her would make like him into time has look two more write go see number no "
    "way could people my than first water been call who its now find long down day did get come made may part"
).split()

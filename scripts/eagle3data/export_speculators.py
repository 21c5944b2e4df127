"""`python -m eagle3data.export_speculators`: the name that dataset cards and export manifests written earlier give
for `eagle3data.exports.speculators`; it runs and imports the same thing.
"""

from eagle3data.exports.speculators import *  # noqa: F401,F403
from eagle3data.exports.speculators import main

if __name__ == "__main__":
    main()

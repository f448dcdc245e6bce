"""``qosgate top``: a live terminal view of gateways from their own HTTP APIs.

:mod:`view` builds each frame from scraped data with pure functions (so tests render canned
scrapes); :mod:`fetch` is the loop that scrapes the gateways and shows the frames.
"""

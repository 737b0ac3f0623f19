"""The front ends' command line: the `spac` app (main.py), the option block every command shares
and its checks (options.py), and the commands that are more than a call into a lower layer:
`spac draft` (drafts.py), `spac trace record` (record.py), `spac sim profile measure`
(profile_measure.py). Nothing below this package imports it."""

if __name__ == "kernels":  # imported by the bare name from a checkout: not this package (sfl/_shadow.py says why)
    from sfl._shadow import defer_to_installed

    defer_to_installed(__name__)

"""The notebooks' pictures and widgets, one module per subject: ``decode`` (03-04), ``memory`` (05), ``paging`` (06),
``schedule`` (07), ``engine`` (08), ``serving`` (09), ``speculation`` (10), ``parallelism`` (11). Each draws from
plain data the layers below return.
"""

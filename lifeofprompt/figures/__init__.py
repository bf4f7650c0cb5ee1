"""The chapters' pictures and widgets, one module per subject: ``decode`` (03-04), ``memory`` (05-06), ``paging`` (07),
``schedule`` (08), ``streaming`` (09), ``engine`` (10, the appendix), ``tiles`` (11), ``structured`` (12), ``serving``
(09, 13), ``speculation`` (14), ``parallelism`` (15). Each draws from plain data the layers below return.
"""

;; A table declared bigger than any store allows (4 Mi elements): it cannot be instantiated.
(module
  (table (export "table") 4194304 funcref)
  (memory (export "memory") 1)
  (func (export "_start")))

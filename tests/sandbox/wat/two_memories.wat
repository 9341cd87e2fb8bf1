;; Two linear memories (multi-memory): each would get the whole memory budget.
(module
  (memory (export "memory") 1)
  (memory (export "other") 1)
  (func (export "_start")))

;; Grow linear memory one page at a time; when memory.grow fails (-1), trap.
(module
  (memory (export "memory") 1)
  (func (export "_start")
    (loop $again
      (if (i32.eq (memory.grow (i32.const 1)) (i32.const -1))
        (then unreachable))
      (br $again))))

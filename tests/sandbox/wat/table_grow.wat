;; Grow an (exported) funcref table 65,536 elements at a time, 64 times (4 Mi elements,
;; 32 MiB of host memory outside linear memory); when table.grow fails (-1), trap.
(module
  (table (export "table") 1 funcref)
  (memory (export "memory") 1)
  (func (export "_start")
    (local $i i32)
    (loop $again
      (if (i32.eq (table.grow (ref.null func) (i32.const 65536)) (i32.const -1))
        (then unreachable))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br_if $again (i32.lt_u (local.get $i) (i32.const 64))))))

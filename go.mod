module github.com/vksparse/vksparse

go 1.22

require github.com/x448/float16 v0.8.4

from stages.scan import command

command()
